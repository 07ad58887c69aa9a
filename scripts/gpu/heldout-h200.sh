#!/usr/bin/env bash
# Held-out CNN jobs (no model of the realworld or grid sets): PyTorch's peaks from a real step
# (gpumem_trace.record) and the probe of exactly their convolutions, for judging the estimate
# on models never seen. Usage on the GPU machine: OUT=dir bash scripts/gpu/heldout-h200.sh
set -u
OUT=${OUT:-gpu-out}; PY=${PYTHON:-python3}
mkdir -p "$OUT/held"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
JOBS=(
  "torchvision:inception_v3 64 adam fp32 3x299x299"
  "torchvision:resnet101 64 adam fp32"
  "torchvision:vgg11 64 sgd-momentum fp32"
  "torchvision:resnext50_32x4d 64 adamw amp-bf16"
  "torchvision:wide_resnet50_2 32 adam fp32"
  "torchvision:squeezenet1_1 128 adam fp32"
  "torchvision:shufflenet_v2_x1_0 128 sgd fp32"
  "torchvision:mnasnet1_0 64 adam fp32"
  "torchvision:alexnet 256 adam fp32"
  "torchvision:googlenet 64 adam amp-bf16"
)
items=()
pids=()
for job in "${JOBS[@]}"; do
  read -r model batch opt prec shape <<<"$job"
  name=$(echo "$model-b$batch-$prec" | tr -c 'A-Za-z0-9_.-' '_' | cut -c1-60)
  args=(--batch "$batch" --optimizer "$opt" --precision "$prec" --iterations 3 --out "$OUT/held/$name.pickle")
  [ -n "${shape:-}" ] && args+=(--input "$shape")
  items+=("$model:$batch:$prec${shape:+:$shape}")
  ( timeout 120 $PY -m gpumem_trace.record "$model" "${args[@]}" > "$OUT/held/$name.json" 2> "$OUT/held/$name.err"; echo "$name rc=$?" ) &
  pids+=($!)
done
timeout 150 $PY -m gpumem_trace.probe --models "${items[@]}" --benchmark off --no-sdpa --out "$OUT/probe-heldout.json" || echo "probe failed: $?"
wait "${pids[@]}"
cat "$OUT"/held/*.json; tail -n 2 "$OUT"/held/*.err | grep -v '^$' | head -30
tar -C "$OUT" -czf "$OUT/heldout.tar.gz" held && rm -rf "$OUT/held"
