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
# The tests run programs as other users (uid 1000, nobody) and move processes between emulated
# nodes that each have a private /tmp, /run and /dev/shm: the checkout must be reachable by every
# user and on every node, and the UNIX socket paths the test programs bind under it must fit in
# 108 bytes. One that is not (a clone into `mktemp -d`, under /root, or at a long path) is tested
# from a copy in /var/tmp, root's, one per checkout path, kept with its build for the next run.
reachable() {
  case "$PWD/" in /tmp/* | /run/* | /dev/shm/*) return 1 ;; esac
  [ "${#PWD}" -le 25 ] && setpriv --reuid=65534 --regid=65534 --clear-groups test -x "$PWD"
}
if [ -z "${FERRY_TEST_COPY_OF:-}" ] && ! reachable; then
  copy=/var/tmp/ferry-$(printf %s "$PWD" | sha256sum | cut -c1-10)
  mkdir -p -m 0755 "$copy"
  # Anyone may create names in /var/tmp: a directory planted there by another user would let
  # them swap what the tests run as root.
  if [ "$(stat -c %u "$copy")" != 0 ] || [ $((8#$(stat -c %a "$copy") & 8#022)) != 0 ]; then
    echo "scripts/test.sh: $copy is not root's alone; remove it and run again" >&2
    exit 1
  fi
  echo "== $PWD is not reachable by every user and node, or too long a path: testing a copy in $copy"
  find "$copy" -mindepth 1 -maxdepth 1 ! -name target -exec rm -rf {} +
  tar -C "$PWD" --exclude=./target -cf - . | tar -C "$copy" -xf -
  chmod 0755 "$copy"
  cd "$copy"
  FERRY_TEST_COPY_OF="$OLDPWD" exec bash scripts/test.sh
fi
bash scripts/install-deps.sh
export PATH="$HOME/.cargo/bin:$PATH"

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
