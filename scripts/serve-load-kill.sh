#!/usr/bin/env bash
# Issue 14's throughput and load-kill acceptance, over the daemon's Unix socket:
#  1. `gpumem load-test` with 16 clients: submissions per second (each answered by the store);
#  2. 16 clients submitting for 10 s while the daemon is killed with SIGKILL 3 times (and
#     restarted): every submission the daemon acknowledged (its id answered) is in the store.
#
#   scripts/serve-load-kill.sh [GPUMEM_BINARY]     (default: target/release/gpumem, built if absent)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/gpumem}
[ -x "$bin" ] || cargo build -q --release -p gpumem-cli
work=$(mktemp -d /tmp/gpumem-load.XXXXXX)
url=unix:$work/gpumem.sock
daemon=
start_daemon() {
    "$bin" serve --fake-gpus 1xa100-40gb --socket "$work/gpumem.sock" --state "$work/state" 2>> "$work/daemon.log" &
    daemon=$!
    for _ in $(seq 200); do "$bin" jobs --server "$url" --state running > /dev/null 2>&1 && return; sleep 0.05; done
    echo "the daemon did not start: $(tail -1 "$work/daemon.log")" >&2
    exit 1
}
start_daemon
"$bin" load-test --server "$url" --jobs 20000 --concurrency 16 --seconds 20 | tee "$work/load.txt"

# 16 clients for 10 s, each acknowledged id appended to a file, while the daemon is killed.
"$bin" load-test --server "$url" --jobs 1000000 --concurrency 16 --seconds 10 --acked "$work/acked" > "$work/acked.txt" &
load=$!
for k in 1 2 3; do
    sleep 2
    kill -9 $daemon; wait $daemon 2>/dev/null || true
    start_daemon
done
wait $load
cat "$work/acked.txt"
"$bin" jobs --server "$url" --json > "$work/jobs.json"
kill $daemon; wait $daemon 2>/dev/null || true
python3 - "$work" <<'EOF'
import json, sys
work = sys.argv[1]
acked = {int(l) for l in open(f"{work}/acked") if l.strip()}
stored = {j["id"] for j in json.load(open(f"{work}/jobs.json"))}
lost = sorted(acked - stored)
print(f"kill -9 x3 under 16 clients: {len(acked)} acknowledged, {len(lost)} lost{': ' + str(lost[:10]) if lost else ''}")
sys.exit(1 if lost else 0)
EOF
