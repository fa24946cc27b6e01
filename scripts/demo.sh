#!/usr/bin/env bash
# The demo: builds Ferry, starts a small program that counts, checkpoints it (killing it),
# restores it under the same PID, and shows it carry on counting where it left off.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
export PATH="$HOME/.cargo/bin:$PATH"
cargo build --release --quiet
ferry=$PWD/target/release/ferry

work=$(mktemp -d /tmp/ferry-demo.XXXXXX)
cat > "$work/counter.c" <<'C'
#include <stdio.h>
#include <unistd.h>
#include <time.h>
int main(void) {
    for (long i = 0;; i++) {
        printf("pid %d: count %ld\n", getpid(), i);
        fflush(stdout);
        struct timespec ts = {0, 300 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}
C
gcc -O1 -o "$work/counter" "$work/counter.c"
setsid "$work/counter" >"$work/out" 2>&1 </dev/null &
pid=$!
sleep 1.5
echo "--- the program runs as PID $pid:"; tail -n 3 "$work/out"
echo "--- ferry checkpoint $pid --dir $work/image"
"$ferry" checkpoint "$pid" --dir "$work/image"
sleep 1
echo "--- it is gone (no output for a second):"; tail -n 1 "$work/out"
echo "--- ferry image show $work/image (first lines)"
"$ferry" image show "$work/image" | sed -n 1,12p
echo "--- ferry restore --dir $work/image"
"$ferry" restore --dir "$work/image"
sleep 1.5
echo "--- it carries on, same PID, same count:"; tail -n 4 "$work/out"
kill -9 "$pid" 2>/dev/null || true
rm -rf "$work"
