#!/usr/bin/env bash
# Runs a command as a freshly booted machine would see kernel-global numbers: in a new IPC
# namespace (the first System V segment is shmid 0) and a new mount namespace with a devpts
# instance of its own (the first pty is /dev/pts/0). The test command runs the tests that depend
# on such numbering once more through this, so a bug that only a fresh machine shows (an id 0
# taken for "none") fails CI on any machine.
#   usage: scripts/fresh-numbering.sh COMMAND [ARGS...]
set -euo pipefail
if [ "$#" -eq 0 ]; then
  echo "usage: $0 COMMAND [ARGS...]" >&2
  exit 2
fi
exec unshare --ipc --mount --propagation private -- bash -c '
  set -euo pipefail
  mount -t devpts -o newinstance,ptmxmode=0666,mode=0620,gid=5 devpts /dev/pts
  mount --bind /dev/pts/ptmx /dev/ptmx
  exec "$@"
' fresh-numbering "$@"
