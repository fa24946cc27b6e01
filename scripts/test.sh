#!/usr/bin/env bash
# The test command: installs what the tests need, checks formatting and lints, builds, and runs
# every test as root. `.ci/run` calls this.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "scripts/test.sh: the engine's tests checkpoint real processes and need root" >&2
  exit 1
fi
# Descriptors this script inherited (a CI runner's pipes) are closed: processes the tests move
# must not share a pipe with something outside the test.
for fd in $(ls /proc/$$/fd); do
  if [ "$fd" -gt 2 ] && [ "$fd" != 255 ]; then eval "exec $fd>&-" 2>/dev/null || true; fi
done
bash scripts/install-deps.sh
export PATH="$HOME/.cargo/bin:$PATH"

# Some tests run programs as other users (uid 1000, nobody): ferry's binary, the compiled test
# programs and their run directories must be reachable by them. A checkout another user cannot
# enter (a clone into `mktemp -d`, or under /root) builds and tests in a root-owned target
# directory under /var/tmp instead, one per checkout path, kept for the next run.
if [ -z "${CARGO_TARGET_DIR:-}" ] && ! setpriv --reuid=65534 --regid=65534 --clear-groups test -x "$PWD"; then
  CARGO_TARGET_DIR=/var/tmp/ferry-target-$(printf %s "$PWD" | sha256sum | cut -c1-16)
  mkdir -p -m 0755 "$CARGO_TARGET_DIR"
  # Anyone may create names in /var/tmp: a directory planted there by another user would let
  # them swap the binaries the tests run as root.
  if [ "$(stat -c %u "$CARGO_TARGET_DIR")" != 0 ] || [ $((8#$(stat -c %a "$CARGO_TARGET_DIR") & 8#022)) != 0 ]; then
    echo "scripts/test.sh: $CARGO_TARGET_DIR is not root's alone; remove it and run again" >&2
    exit 1
  fi
  export CARGO_TARGET_DIR
  echo "== $PWD cannot be entered by other users: building in $CARGO_TARGET_DIR"
fi

echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "== cargo test"
cargo build --workspace --quiet
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --workspace --quiet -- --test-threads=1 2>&1 | tee "$log"
# Kernel-global numbers start at zero on a freshly booted machine (the first System V segment is
# shmid 0, the first pty /dev/pts/0): what depends on them runs once more where they do.
echo "== again, numbered as on a freshly booted machine (new IPC namespace and devpts instance)"
FERRY_SUITE_FILTER=sysv,pty,tty bash scripts/fresh-numbering.sh \
  cargo test --quiet -p ferry --test cli --test engine_suite -- --test-threads=1 2>&1 | tee -a "$log"
# One closing line with the totals over every test binary (cargo's last one is often an empty
# doc-test run).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "tests: %d passed, %d failed\n", p, f; exit (f > 0) }' "$log"
