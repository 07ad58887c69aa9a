#!/usr/bin/env bash
# Issue 14's kill acceptance: 50 jobs through `gpumem serve` on fake GPUs while the daemon is
# killed with SIGKILL 10 times (and restarted) and 10 random job supervisors are killed with
# SIGKILL. Then: every job ends (none lost), none started twice, no run overlapped another run
# of the same job, and no process of any job is left.
#
#   scripts/serve-chaos.sh [GPUMEM_BINARY]     (default: target/release/gpumem, built if absent)
#   CGROUPS=false scripts/serve-chaos.sh       (process groups only, no cgroup per run)
#
# Prints one line of figures and exits non-zero if any check fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/gpumem}
[ -x "$bin" ] || cargo build -q --release -p gpumem-cli
work=$(mktemp -d /tmp/gpumem-chaos.XXXXXX)
state=$work/state marks=$work/marks
mkdir -p "$marks"
printf 'policy = "first-fit"\nwarmup_s = 1\ntick_ms = 50\ngrace_s = 1\ncgroups = %s\n' "${CGROUPS:-true}" > "$work/daemon.toml"
url=unix:$work/gpumem.sock
daemon=
start_daemon() {
    "$bin" serve --fake-gpus 4xa100-40gb --socket "$work/gpumem.sock" --state "$state" --config "$work/daemon.toml" 2>> "$work/daemon.log" &
    daemon=$!
    for _ in $(seq 100); do "$bin" jobs --server "$url" > /dev/null 2>&1 && return; sleep 0.05; done
    echo "the daemon did not start: $(tail -1 "$work/daemon.log")" >&2
    exit 1
}
start_daemon

# Each job notes its start and end, leaves a background child (`sleep 61`, which its end must
# kill) and runs 2-5 s on 8000 MiB: 16 fit at once on four 40 GB GPUs, so the others queue.
for i in $(seq 50); do
    job="echo start \$GPUMEM_JOB_ATTEMPT \$(date +%s.%N) >> $marks/\$GPUMEM_JOB_ID; echo \$((8000*1048576)) > \"\$GPUMEM_FAKE_MEMORY_FILE\"; sleep 61 & sleep $((2 + i % 4)); echo end \$(date +%s.%N) >> $marks/\$GPUMEM_JOB_ID"
    "$bin" submit --server "$url" --mem-mib 8000 --shell "$job" > /dev/null
done

daemon_kills=0 supervisor_kills=0
while [ $daemon_kills -lt 10 ] || [ $supervisor_kills -lt 10 ]; do
    sleep 0.5
    [ $SECONDS -lt 240 ] || { echo "fewer than 10 supervisors ran to be killed" >&2; exit 1; }
    if [ $supervisor_kills -lt 10 ]; then
        pids=$(for f in "$state"/jobs/*/pid; do p=$(cat "$f" 2>/dev/null) && grep -qa _supervise /proc/$p/cmdline 2>/dev/null && echo $p; done || true)
        if [ -n "$pids" ]; then
            kill -9 $(echo "$pids" | shuf -n 1) 2>/dev/null && supervisor_kills=$((supervisor_kills + 1)) || true
        fi
    fi
    if [ $daemon_kills -lt 10 ]; then
        kill -9 $daemon; wait $daemon 2>/dev/null || true
        daemon_kills=$((daemon_kills + 1))
        start_daemon
    fi
done

# Every job ends.
for _ in $(seq 600); do
    left=$("$bin" jobs --server "$url" --json | python3 -c 'import json,sys; print(sum(j["state"] not in ("finished","failed","cancelled") for j in json.load(sys.stdin)))')
    [ "$left" = 0 ] && break
    sleep 0.2
done
"$bin" jobs --server "$url" --json > "$work/jobs.json"
kill $daemon; wait $daemon 2>/dev/null || true
sleep 0.3

python3 - "$work" <<'EOF'
import json, os, subprocess, sys
work = sys.argv[1]
jobs = json.load(open(f"{work}/jobs.json"))
states = {}
for j in jobs:
    states[j["state"]] = states.get(j["state"], 0) + 1
twice = overlapping = never = 0
for j in jobs:
    path = f"{work}/marks/{j['id']}"
    lines = open(path).read().split() if os.path.exists(path) else []
    starts = [float(lines[i + 2]) for i in range(len(lines)) if lines[i] == "start"]
    ends = [float(lines[i + 1]) for i in range(len(lines)) if lines[i] == "end"]
    never += not starts
    twice += len(starts) > 1
    # A second start before the first run's end is an overlap.
    overlapping += len(starts) > 1 and (not ends or starts[1] < ends[0])
ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
orphans = sum(1 for a in ps if a.strip() == "sleep 61") + sum(1 for a in ps if "_supervise" in a and work in a)
lost = 50 - len(jobs) + sum(n for s, n in states.items() if s not in ("finished", "failed", "cancelled"))
print(f"jobs {len(jobs)}; states {states}; lost {lost}; never started {never}; started twice {twice}; overlapping {overlapping}; orphan processes {orphans}")
sys.exit(0 if lost == 0 and twice == 0 and overlapping == 0 and orphans == 0 and never == 0 else 1)
EOF
echo "daemon kills $daemon_kills, supervisor kills $supervisor_kills; files in $work"
