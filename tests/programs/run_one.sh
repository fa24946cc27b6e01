#!/bin/bash
# Run one engine-suite program by hand, natively or through ferry.
#   tests/programs/run_one.sh NAME            native: ready -> go -> result
#   FERRY=path/to/ferry tests/programs/run_one.sh NAME   checkpoint+restore twice first
#   STOPCONT=1 tests/programs/run_one.sh NAME  stop the whole tree (SIGSTOP) for
#       1.5 s twice before go: a cheap check that the program tolerates being
#       frozen for a while (a few kinds, e.g. sigtimedwait and epoll_wait,
#       return EINTR after SIGSTOP/SIGCONT by kernel design and fail here)
# Leaves the test dir (T) and images under ${FERRY_RUN_DIR:-/tmp/ferry-run}/NAME.
set -u
here=$(cd "$(dirname "$0")" && pwd)
name=${1%.c}
base=${FERRY_RUN_DIR:-/tmp/ferry-run}/$name
rm -rf "$base" && mkdir -p "$base/t"
T=$base/t
gcc -O1 -g -pthread -Wall -o "$base/$name" "$here/$name.c" -lrt || exit 2
FERRY_TEST_DIR=$T setsid "$base/$name" </dev/null >>"$T/log" 2>&1 &
pid=$!
wait_file() { # file seconds
	for _ in $(seq $(($2 * 100))); do [ -e "$1" ] && return 0; sleep 0.01; done
	return 1
}
if ! wait_file "$T/ready" 10; then echo "no ready file"; cat "$T/log"; kill -9 -- -$pid 2>/dev/null; exit 1; fi
tree() { # pid and all its descendants
	ps -eo pid=,ppid= | awk -v root="$1" '{ parent[$1] = $2 } END {
		for (p in parent) { q = p; while (q in parent && q != root && q > 1) q = parent[q]; if (q == root) print p } }'
}
if [ -n "${STOPCONT:-}" ]; then
	for round in 1 2; do
		pids=$(tree $pid)
		kill -STOP $pids 2>/dev/null
		sleep 1.5
		kill -CONT $pids 2>/dev/null
	done
fi
if [ -n "${FERRY:-}" ]; then
	for round in 1 2; do
		"$FERRY" checkpoint "$pid" --dir "$base/img$round" || { echo "checkpoint $round failed"; break; }
		wait $pid 2>/dev/null
		new=$("$FERRY" restore --dir "$base/img$round" | tail -n1)
		echo "restore $round: pid $new"
	done
fi
touch "$T/go"
wait_file "$T/result" 20
res=$(cat "$T/result" 2>/dev/null || echo '<none>')
echo "$name: $res"
[ "$res" = PASS ] || { echo "--- log:"; cat "$T/log"; }
sleep 0.1; kill -9 -- -$pid 2>/dev/null; wait 2>/dev/null
[ "$res" = PASS ]
