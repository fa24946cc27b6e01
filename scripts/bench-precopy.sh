#!/bin/bash
# Pre-copy against a writer: the freeze of eager and pre-copy migration between two nodes of a
# local cluster, for a process holding MIB of memory that dirties RATE % of it per second
# (tests/victims/dirtier.c: random pages, one write in 64 a dropped page). After each move the
# victim checks all its pages against its own table; a damaged page fails the run.
#
#   cargo build --release -p ferry && MIB=512 RATES="0 1 10 25" bash scripts/bench-precopy.sh
set -euo pipefail
cd "$(dirname "$0")/.."
FERRY=${FERRY:-$PWD/target/release/ferry}
MIB=${MIB:-512}
RATES=${RATES:-"0 1 10 25"}
MODES=${MODES:-"eager precopy"}
DIR=$(mktemp -d /tmp/ferry-bench-precopy.XXXXXX)
gcc -O2 -o "$DIR/dirtier" tests/victims/dirtier.c
export FERRY_CLUSTER_DIR=$DIR/cluster
"$FERRY" cluster up --nodes 2 --isolation shared --first-addr 127.0.0.71 --port 7394 --no-confine-guests >/dev/null
VICTIM=
cleanup() {
    [ -n "$VICTIM" ] && kill -9 "$VICTIM" 2>/dev/null || true
    "$FERRY" cluster down >/dev/null 2>&1 || true
    rm -rf "$DIR"
}
trap cleanup EXIT
echo "| dirtied (% of $MIB MiB per s) | mode | freeze (ms) | rounds: MiB sent (ms) | sent in the freeze (MiB) | total (ms) | wire (MiB) |"
echo "|---|---|---|---|---|---|---|"
for rate in $RATES; do
    for mode in $MODES; do
        pages=$((MIB * 256 * rate / 100))
        rm -f "$DIR/status"
        "$DIR/dirtier" "$MIB" "$pages" "$DIR/status" </dev/null >/dev/null 2>&1 &
        pid=$!
        until grep -q "count=" "$DIR/status" 2>/dev/null; do sleep 0.05; done
        sleep 1
        "$FERRY" --node a migrate "$pid" --to b --memory "$mode" --json >"$DIR/r.json"
        VICTIM=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["dest_pid"])' "$DIR/r.json")
        sleep 1.3
        grep -q "ok=1" "$DIR/status" || { echo "rate $rate $mode: memory damaged: $(cat "$DIR/status")" >&2; exit 1; }
        python3 - "$DIR/r.json" "$rate" "$mode" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
m = r["memory"]
M = 1 << 20
rounds = ", ".join("%.1f (%.0f)" % (x["sent_bytes"] / M, x["ms"]) for x in m["rounds"]) or "-"
print("| %s | %s | %.0f | %s | %.1f | %.0f | %.0f |" % (sys.argv[2], m["mode"], r["freeze_ms"], rounds,
      m["frozen_bytes"] / M, r["total_ms"], r["wire_bytes"] / M))
PY
        kill -9 "$VICTIM" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
        VICTIM=
    done
done
