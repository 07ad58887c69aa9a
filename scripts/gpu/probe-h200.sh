#!/usr/bin/env bash
# The GPU check of the probe issue, as one short run on a GPU machine (about 5 minutes on an
# H200; nothing is downloaded). Writes into $OUT (default ./gpu-out):
#   probe-jobs.json   gpumem_trace.probe on the convolutions of the CNN jobs below (cuDNN
#                     heuristics and benchmark mode), the context, cuBLAS and SDPA facts
#   probe-grid.json   the same, heuristics only, on the default grid (common CNNs)
#   records.tar.gz    gpumem_trace.record snapshots (PyTorch's own) of each job, and their peaks
#   log.txt           everything printed
# Usage (repository root, on the GPU machine): bash scripts/gpu/probe-h200.sh
# Then, here: gpumem probe --import gpu-out/probe-jobs.json ... (see docs/probe.md).
set -u
OUT=${OUT:-gpu-out}
PY=${PYTHON:-python3}
mkdir -p "$OUT/rec"
STEPS=${STEPS:-probe,record,grid}  # a rerun can name fewer
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
started=$(date +%s)
lap() { echo "== $(( $(date +%s) - started )) s: $*"; }

$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv

# The jobs of ../shared/data/h200/realworld_dev_h200.csv (model batch optimizer precision [input|seq]).
JOBS=(
  "torchvision:resnet50 32 adam fp32"
  "torchvision:resnet50 128 adam fp32"
  "torchvision:vgg16 128 adam fp32"
  "torchvision:mobilenet_v2 128 adam fp32"
  "torchvision:efficientnet_b0 128 adam fp32"
  "torchvision:resnet50 128 adam amp-bf16"
  "torchvision:resnet18 256 sgd-momentum fp32"
  "torchvision:vgg16 32 adam fp32"
  "torchvision:resnet50 256 adam fp32"
  "hf:GPT2LMHeadModel(n_embd=768,n_layer=12,n_head=12) 8 adamw fp32 1024"
  "hf:BertForMaskedLM(hidden_size=768,num_hidden_layers=12,num_attention_heads=12,intermediate_size=3072,vocab_size=28996) 16 adamw fp32 512"
  "hf:LlamaForCausalLM(hidden_size=1024,intermediate_size=2816,num_hidden_layers=8,num_attention_heads=16,num_key_value_heads=4,vocab_size=32000) 8 adamw amp-bf16 1024"
  "torchvision:resnet18 4 adam fp32"
)

# 1. The probe alone on the GPU first (its context figures need a quiet device).
if [[ $STEPS == *probe* ]]; then
lap "probe: job convolutions"
if [ -f scripts/gpu/convs-jobs.json ]; then src=(--configs scripts/gpu/convs-jobs.json); else src=(--models "${JOBS[@]:0:9}"); fi
timeout 200 $PY -m gpumem_trace.probe "${src[@]}" --benchmark both --seconds 75 --out "$OUT/probe-jobs.json" || echo "probe-jobs failed: $?"
fi

# 2. Each job's real training step with PyTorch's snapshot, seven at a time (separate processes:
#    each has its own allocator; sizes and order do not depend on the neighbours).
# (The grid's heuristic probe runs beside them: cuDNN's heuristics do not time anything.)
if [[ $STEPS == *grid* ]]; then
lap "probe: grid (in the background)"
if [ -f scripts/gpu/convs-grid.json ]; then src=(--configs scripts/gpu/convs-grid.json); else src=(); fi
timeout 100 $PY -m gpumem_trace.probe "${src[@]}" --benchmark off --no-sdpa --seconds 70 --out "$OUT/probe-grid.json" &
grid=$!
fi
if [[ $STEPS == *record* ]]; then
lap "record"
pids=()
for job in "${JOBS[@]}"; do
  read -r model batch opt prec extra <<<"$job"
  name=$(echo "$model-b$batch-$prec" | tr -c 'A-Za-z0-9_.-' '_' | cut -c1-60)
  args=(--batch "$batch" --optimizer "$opt" --precision "$prec" --iterations 3 --out "$OUT/rec/$name.pickle")
  [ -n "${extra:-}" ] && args+=(--seq-len "$extra")
  ( timeout 100 $PY -m gpumem_trace.record "$model" "${args[@]}" > "$OUT/rec/$name.json" 2> "$OUT/rec/$name.err"; echo "$name rc=$?" ) &
  pids+=($!)
  if [ ${#pids[@]} -ge 7 ]; then wait "${pids[@]}"; pids=(); fi
done
[ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
cat "$OUT"/rec/*.json
tail -n 3 "$OUT"/rec/*.err 2>/dev/null | grep -v '^$' | head -40
fi
[ -n "${grid:-}" ] && { wait "$grid" || echo "probe-grid failed: $?"; }

lap "pack"
tar -C "$OUT" -czf "$OUT/records.tar.gz" rec && rm -rf "$OUT/rec"
ls -la "$OUT"
lap "done"
