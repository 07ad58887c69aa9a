#!/usr/bin/env bash
# Issue 16's GPU check: a single-GPU LoRA fine-tune and a pure-bf16 full fine-tune of small
# Llama configs, run for real (gpumem_trace.record: PyTorch's peaks and the device memory in
# use at the end), to set beside `gpumem estimate` of the same jobs (JOBS below, each line's
# flags are the estimate's: `gpumem estimate MODEL --batch B FLAGS --gpu h200 --json`).
# Usage on the GPU machine: OUT=dir bash scripts/gpu/lora-h200.sh   (about 5 minutes on an H200)
set -u
OUT=${OUT:-gpu-out}; PY=${PYTHON:-python3}
mkdir -p "$OUT/lora"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
TINYLLAMA="hf:LlamaForCausalLM(hidden_size=2048,intermediate_size=5632,num_hidden_layers=22,num_attention_heads=32,num_key_value_heads=4,vocab_size=32000)"
LLAMA350M="hf:LlamaForCausalLM(hidden_size=1024,intermediate_size=2816,num_hidden_layers=16,num_attention_heads=16,num_key_value_heads=16,vocab_size=32000)"
# name | model | batch | flags (record's and the estimate's)
JOBS=(
  "lora-qv-ckpt|$TINYLLAMA|4|--seq-len 1024 --optimizer adamw --precision bf16 --checkpointing --lora-rank 16 --lora-alpha 32 --lora-targets q_proj,v_proj"
  "lora-all|$TINYLLAMA|2|--seq-len 1024 --optimizer adamw --precision bf16 --lora-rank 16 --lora-alpha 32 --lora-targets all-linear"
  "bf16-full|$LLAMA350M|8|--seq-len 1024 --optimizer adamw --precision bf16"
  "bf16-full-ckpt|$LLAMA350M|16|--seq-len 1024 --optimizer adamw --precision bf16 --checkpointing"
  # Autocast with checkpointing: the recomputation's weight casts (the emulated cast cache).
  "amp-bf16-ckpt|$LLAMA350M|16|--seq-len 1024 --optimizer adamw --precision amp-bf16 --checkpointing"
)
for job in "${JOBS[@]}"; do
  IFS='|' read -r name model batch flags <<<"$job"
  # shellcheck disable=SC2086
  timeout 150 $PY -m gpumem_trace.record "$model" --batch "$batch" $flags --out "$OUT/lora/$name.pickle" > "$OUT/lora/$name.json" 2> "$OUT/lora/$name.err"
  echo "$name rc=$?"; cat "$OUT/lora/$name.json"; tail -n 2 "$OUT/lora/$name.err"
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
tar -C "$OUT" -czf "$OUT/lora.tar.gz" lora && rm -rf "$OUT/lora"
