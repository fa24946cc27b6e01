#!/usr/bin/env bash
# The demo: builds Ferry, starts a local cluster of three node daemons (mutual TLS between them):
# node a is this machine, b and c are as separate as one kernel allows (a network, host name,
# /tmp, /run and PIDs of their own, on a bridge of the cluster's), and all three share the demo's
# directory, as machines share a network file system. It starts a small program that counts,
# and moves it live from node a to b, to c and home to a, while you watch its output carry on:
# same PID in its own eyes, same count, never a gap it could notice; even the host name it sees
# stays its home's. Away from home it sees only the shared directory and the system's files.
set -euo pipefail
cd "$(dirname "$0")/.."
# Descriptors this script inherited (an IDE's or a runner's pipes) are closed: the program it
# moves should hold only what it opens itself, as one started from a terminal does.
for fd in $(ls /proc/$$/fd); do
  if [ "$fd" -gt 2 ] && [ "$fd" != 255 ]; then eval "exec $fd>&-" 2>/dev/null || true; fi
done
bash scripts/install-deps.sh
export PATH="$HOME/.cargo/bin:$PATH"
echo "--- building Ferry (release)"
cargo build --release --quiet -p ferry
ferry=$PWD/target/release/ferry

work=$(mktemp -d /tmp/ferry-demo.XXXXXX)
export FERRY_CLUSTER_DIR=$work/cluster
pid=
cleanup() {
  # The program's copy on node a (this machine): PIDs of other nodes are theirs, not ours, and
  # what runs there ends with `cluster down`.
  [ -n "$pid" ] && "$ferry" ps 2>/dev/null | awk '$3 == "a" {print $4}' | xargs -r kill -9 2>/dev/null || true
  [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null || true
  "$ferry" cluster down >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

cat > "$work/counter.c" <<'C'
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
int main(void) {
    char host[64];
    size_t len = 64 << 20;                 /* 64 MiB of state to carry along */
    char *state = malloc(len);
    memset(state, 7, len);
    for (long i = 0;; i++) {
        long sum = 0;
        for (size_t j = 0; j < len; j += 4096) sum += state[j];
        gethostname(host, sizeof host);
        printf("I am PID %d on %s, count %ld, my 64 MiB are %s\n", getpid(), host, i,
               sum == 7L * (long)(len / 4096) ? "intact" : "DAMAGED");
        fflush(stdout);
        struct timespec ts = {0, 400 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}
C
gcc -O1 -o "$work/counter" "$work/counter.c"

echo "--- ferry cluster up --nodes 3 --shared $work"
"$ferry" cluster up --nodes 3 --shared "$work"
echo "--- ferry nodes"
"$ferry" nodes

# Started in the shared tree: away from home, a guest sees only that and the system's files.
cd "$work"
setsid ./counter >"$work/out" 2>&1 </dev/null &
pid=$!
disown "$pid"   # it will be killed where it stood after each move: no job-control noise
sleep 1.5
echo "--- the program runs on node a as PID $pid:"
tail -n 2 "$work/out"

from=a
for to in b c a; do
  echo
  echo "--- ferry --node $from migrate $pid --to $to"
  "$ferry" --node "$from" migrate "$pid" --to "$to"
  sleep 1.5
  echo "--- its output carries on (the last lines):"
  tail -n 3 "$work/out"
  echo "--- ferry ps"
  "$ferry" ps
  from=$to
done
echo
echo "The program moved a -> b -> c -> a without a gap, under its own PID $pid throughout."
echo "(Stopping the cluster and the program.)"
