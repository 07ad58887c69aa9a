#!/usr/bin/env bash
# The probe issue's commands end to end on a GPU machine, with a gpumem binary built elsewhere
# (BIN, default .bin/gpumem) and the machine's python3 (torch): gpumem probe on the GPU,
# an estimate with the probed profile, PyTorch's snapshot of the same job, gpumem diff, and
# gpumem serve probing a submitted job's convolutions on the real GPU (probe_s).
set -u
OUT=${OUT:-gpu-out}; BIN=${BIN:-.bin/gpumem}
mkdir -p "$OUT"
export GPUMEM_PYTHON=python3 GPUMEM_CACHE=/tmp/gpumem-cache PYTHONPATH="$PWD/python" PYTHONUNBUFFERED=1
JOB=(torchvision:resnet18 --batch 8 --input 3x64x64)
echo "== probe"; timeout 120 $BIN probe --gpu 0 --models torchvision:resnet18:8:fp32:3x64x64 --benchmark off --out "$OUT/probe-cli.toml" || echo "probe rc=$?"
grep -c "conv_workspace" "$OUT/probe-cli.toml"
echo "== estimate"; timeout 120 $BIN estimate "${JOB[@]}" --profile "$OUT/probe-cli.toml" | head -12
echo "== record"; timeout 120 python3 -m gpumem_trace.record "${JOB[@]}" --out "$OUT/r18.pickle"
echo "== diff"; timeout 60 $BIN diff "${JOB[@]}" --profile "$OUT/probe-cli.toml" --snapshot "$OUT/r18.pickle"
echo "== serve with probe_s"
printf 'probe_s = 60\ntick_ms = 100\nwarmup_s = 1\n' > /tmp/daemon.toml
$BIN serve --gpu h200 --socket /tmp/gpumem.sock --state /tmp/st --config /tmp/daemon.toml > /tmp/serve.log 2>&1 &
sleep 2
$BIN submit --server unix:/tmp/gpumem.sock --json --model torchvision:resnet50 --batch 16 --input 3x96x96 -- python3 -c 'print("ran")'
for i in $(seq 1 40); do s=$($BIN job 1 --server unix:/tmp/gpumem.sock --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])'); [ "$s" = finished ] && break; sleep 1; done
$BIN job 1 --server unix:/tmp/gpumem.sock --json | head -30
grep -c "conv_workspace" /tmp/st/profile.toml; ls -la /tmp/st; tail -5 /tmp/serve.log
