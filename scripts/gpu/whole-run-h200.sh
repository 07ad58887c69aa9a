#!/usr/bin/env bash
# Issue 34's GPU check: four fine-tunes' whole runs for real (scripts/gpu/whole_run.py: load,
# PEFT's prepare, Trainer steps, Trainer evaluation with metrics — with and without
# eval_accumulation_steps — and the Trainer's checkpoint save), each part's PyTorch peaks and
# device memory, to set beside `gpumem estimate … --whole-run` of the same jobs.
#   qlora-llama8b: a Llama-3.1-8B-shaped QLoRA (nf4, double quantization, bf16 compute,
#     prepare_model_for_kbit_training, LoRA r 16 on every linear layer), batch 4 × 1,024.
#   qlora-mistral7b: a Mistral-7B-shaped QLoRA as the QLoRA paper trains (LoRA r 64 on every
#     linear layer), bitsandbytes' 8-bit AdamW, batch 2 × 2,048 with 2 accumulation steps.
#   qlora-llama1b: a Llama-3.2-1B-shaped QLoRA (its head tied to its embeddings), batch 4 ×
#     1,024, its evaluation with eval_accumulation_steps 2 alone (the cache emptied after each).
#   lora-qwen05b: docs/run.md's example, a Qwen2-0.5B-shaped bf16 LoRA on q_proj,v_proj, batch
#     4 × 1,024, 20 evaluation batches with metrics.
# Usage on the GPU machine (bitsandbytes carried as a wheel, see the device README):
#   OUT=dir bash scripts/gpu/whole-run-h200.sh        (about 5 minutes on an H200)
set -u
OUT=${OUT:-gpu-out}; PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
W=scripts/gpu/whole_run.py
CK=${CHECKPOINTS:-/tmp/whole-run}
LLAMA8B='{"model_type":"llama","hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256,"max_position_embeddings":8192,"rope_theta":500000.0,"tie_word_embeddings":false}'
QLORA='{"name":"qlora-llama8b","quant":"nf4","r":16,"alpha":32,"dropout":0.05,"targets":["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"],"batch":4,"seq":1024,"eval_batch":4,"eval_batches":8,"eval_accumulation":[null,2]}'
MISTRAL7B='{"model_type":"mistral","hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"vocab_size":32000,"max_position_embeddings":32768,"tie_word_embeddings":false}'
QLORA_MISTRAL='{"name":"qlora-mistral7b","quant":"nf4","r":64,"alpha":16,"dropout":0.1,"targets":["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"],"batch":2,"seq":2048,"grad_accum":2,"optim":"adamw_bnb_8bit","eval_batch":2,"eval_batches":4}'
LLAMA1B='{"model_type":"llama","hidden_size":2048,"intermediate_size":8192,"num_hidden_layers":16,"num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256,"max_position_embeddings":8192,"rope_theta":500000.0,"tie_word_embeddings":true}'
QLORA_1B='{"name":"qlora-llama1b","quant":"nf4","r":16,"alpha":32,"dropout":0.05,"targets":["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"],"batch":4,"seq":1024,"eval_batch":4,"eval_batches":8,"eval_accumulation":[2]}'
QWEN05B='{"model_type":"qwen2","hidden_size":896,"intermediate_size":4864,"num_hidden_layers":24,"num_attention_heads":14,"num_key_value_heads":2,"vocab_size":151936,"max_position_embeddings":32768,"tie_word_embeddings":true}'
LORA='{"name":"lora-qwen05b","r":16,"alpha":32,"targets":["q_proj","v_proj"],"batch":4,"seq":1024,"eval_batch":4,"eval_batches":20,"eval_accumulation":[null,4,2]}'
$PY -c 'import torch, transformers, peft, accelerate, bitsandbytes as b; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__, "accelerate", accelerate.__version__, "bitsandbytes", b.__version__)' | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/versions.txt"
run() {  # name model-json job-json checkpoint-seconds run-seconds
  local t0=$SECONDS
  timeout "$4" $PY $W make-checkpoint "$CK/$1" "$2" 2> "$OUT/$1-checkpoint.err"
  echo "$1 checkpoint rc=$? $((SECONDS - t0))s"; tail -n 3 "$OUT/$1-checkpoint.err"
  t0=$SECONDS
  timeout "$5" $PY $W run "$CK/$1" "$3" > "$OUT/$1.jsonl" 2> "$OUT/$1.err"
  echo "$1 run rc=$? $((SECONDS - t0))s"; cat "$OUT/$1.jsonl"; tail -n 5 "$OUT/$1.err"
  rm -rf "${CK:?}/$1"
}
# JOBS picks some (a second call measures only what the first did not).
for job in ${JOBS:-context qlora-llama8b qlora-mistral7b qlora-llama1b lora-qwen05b}; do
  case $job in
    context) timeout 60 $PY $W context > "$OUT/context.jsonl" 2> "$OUT/context.err"; echo "context rc=$?"; cat "$OUT/context.jsonl"; tail -n 3 "$OUT/context.err" ;;
    qlora-llama8b) run qlora-llama8b "$LLAMA8B" "$QLORA" 150 150 ;;
    qlora-mistral7b) run qlora-mistral7b "$MISTRAL7B" "$QLORA_MISTRAL" 120 120 ;;
    qlora-llama1b) run qlora-llama1b "$LLAMA1B" "$QLORA_1B" 60 100 ;;
    lora-qwen05b) run lora-qwen05b "$QWEN05B" "$LORA" 40 90 ;;
  esac
done
