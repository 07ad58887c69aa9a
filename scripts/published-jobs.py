#!/usr/bin/env python3
"""Writes data/published/jobs.toml: the gpumem job (or the reason there is none) of every row of
the published dev set (/work/shared/data/published/published_runs_dev.csv, or $PUBLISHED_CSV).

The mapping is made by the RULES below, applied per source; each row's own columns (model, GPU,
GPU count, strategy, precision, micro-batch, length, checkpointing, optimizer, other settings)
fill them in. Nothing here reads `measured_gib`: the jobs are fixed before any estimate is seen.
Stdlib only.

RULES (stated once; every row follows them)
 R1 precision. A model loaded in 16 bits and trained so (ms-swift's bf16 default, litgpt
    `bf16-true`, torchtune `bf16`, PEFT/HF scripts loading `torch_dtype=bf16`, unsloth/HF QLoRA
    compute dtype) -> `bf16` (pure). fp32 weights under autocast (HF Trainer `fp16=True` on an
    fp32 model, timm AMP) -> `amp-fp16` / `amp-bf16`. torchtitan "bf16 mixed" is FSDP2 with fp32
    shards and MixedPrecisionPolicy(param_dtype=bf16) -> `fp32 --fsdp-param-dtype bf16`.
    fp32 -> `fp32`.
 R2 LoRA. Targets as the row states them (litgpt: query->q_proj, key->k_proj, value->v_proj,
    projection->o_proj, mlp->gate/up/down (Falcon: dense_h_to_4h/dense_4h_to_h, Phi: fc1/fc2),
    head->lm_head; torchtune "Q and V" -> q_proj,v_proj; "all linear" -> all-linear). QLoRA ->
    `quant=nf4`, double quantization unless the framework's NF4 has none (litgpt `bnb.nf4`,
    torchtune NF4Tensor -> `double_quant=false`). Rank/alpha as stated, else the framework default.
    litgpt quantizes through Lightning Fabric's BitsandbytesPrecision -> `loader=fabric`; its
    releases of 2024 pinned bitsandbytes 0.42.0 (pyproject.toml, 2024-03-11 to 2024-12-28) ->
    `bnb=0.42` for rows of 2024.
 R3 checkpointing. on / full / per-Block -> `--checkpointing`; per-op SAC -> `--selective-checkpointing`
    (torchtitan's and torchao's torchtitan rows: torchtitan's own op policy,
    `--checkpointing=selective-op` — amended 2026-12-07: gpumem's `selective` saves every matmul);
    "not stated" -> the framework's default config of the time where the row's notes name it,
    else off.
 R4 optimizer. AdamW (any implementation: HF default, fused, foreach) -> `adamw` (amended
    2026-12-08: HF's `adamw_hf` stated -> `transformers-adamw`, transformers' own class, which
    gpumem now models; see also R18's implementation); bitsandbytes
    8-bit -> `adamw8bit`, paged -> `paged-adamw8bit`; Adafactor -> `adafactor` (refused by gpumem
    builds without it: recorded as a gpumem refusal, not re-mapped). litgpt with `--quantize
    bnb.*` swaps an AdamW for bitsandbytes' PagedAdamW (instantiate_bnb_optimizer) ->
    `paged_adamw_32bit`.
 R5 lengths. A dataset truncated/padded to a stated maximum -> `--seq-len MAX` (the run's peak
    step is its longest batch); tagged `varlen` where lengths vary per batch. Packing -> the packed
    length, no tag.
 R6 model code. litgpt's GPT -> litgpt's own model, `litgpt:NAME` (its config of the row's
    checkpoint: LITGPT_NAMES), its LoRA targets in litgpt's names. Another framework's own model
    implementation (torchtitan/torchtune Llama) -> the Hugging Face transformers class of the same
    checkpoint, config from data/hub-configs; tagged `framework-model`. Instruct/chat variants use
    their own config.
 R7 torch.compile -> traced eager; tagged `compile`. Amended 2026-12-08: where the trainer
    compiles its loss with it -> `--compile`, the loss compiled as gpumem now models it (the
    model's compiled blocks stay traced eagerly): torchtune's `compile_loss` (its chunked
    cross-entropy's slices); torchtitan where the run's release compiled its loss — from
    2024-10-22 to 2024-12-18 and from 2025-04-02 on (its git history: e10cb949, e8977b00,
    bbb1b616) — placed by a date in the row (YYYY-MM, a nightly's devYYYYMMDD, a year from 2026);
    a row that cannot be placed (torchtitan 0.0.2 spans April 2024 to June 2025) stays eager,
    the larger estimate, as gpumem's reader takes torchtitan's older `training.compile`.
 R8 GPUs. The row's GPU profile where gpumem has it; A800 80GB -> a100-80gb; "A100" with
    figures above 40 GiB or stated 80GB -> a100-80gb; RTX 4070 Ti SUPER -> rtx4090 (same Ada
    architecture; only torch-side figures are compared); Titan RTX 24GB -> rtx3090; B200 /
    unnamed Blackwell -> h200; "N GB GPU" (unsloth context tables) -> a10's kernels with a
    capacity of N GiB; GPU not stated -> a100-80gb (torch-side figures only). Each substitute is
    tagged `gpu-substitute`. MI300X (ROCm) has no equivalent -> not expressible.
 R9 measured quantity. torch max_memory_allocated -> gpumem's allocated peak
    (allocator.peak_allocated); max_memory_reserved / torchtitan "memory" -> reserved peak
    (allocator.peak_reserved); nvidia-smi / NVML / unnamed per-GPU figures -> `peak_mib` (as
    nvidia-smi shows it). Statistic not named ("Peak memory", "GRAM", "GB GPU") -> reserved for
    PyTorch-logged tables (torchtune, torchao), nvidia-smi for screenshots/tool-less figures.
    A figure measured over a whole run (evaluation, saving, other lengths) is compared with the
    training step's peak and tagged `whole-run`.
 R10 multi-GPU. One rank: FSDP (1 or 2) -> `--strategy fsdp --world-size N` (FSDP1 tagged
    `fsdp1`), DDP -> `ddp`, DeepSpeed ZeRO-k -> `zerok` (offload via data/published/*.json).
    device_map model splitting, tensor/expert/sequence parallelism -> not expressible.
 R11 OOM rows. "OOM" -> the estimate must say it does not fit; "largest batch / context that
    fit in C" -> the estimate at that batch/context must fit C (and is reported as a fraction of C).
 R12 Rows whose job is not stated well enough to run (model, batch or length missing, settings
    only in an unread notebook, requirement statements, ranges) are not expressible: `vague`.
 R13 attention (Hugging Face models; a framework's own model keeps its own SDPA). FlashAttention
    stated (flash-attn, FA2, flash_attention) -> `--attention flash`, where it can run (fp16/bf16
    on an Ampere or newer GPU). Else a source from before transformers made SDPA its default
    (v4.36, December 2023: a release v4.0x-v4.35 or a year up to 2023 in the source) ->
    `--attention eager`, the only implementation transformers had then.
 R14 training loop. litgpt's scripts keep the model's output (`logits = model(input_ids)`)
    until the next forward returns: what a `litgpt:` model's step does.
 R16 float8 (added 2026-12-07). Linears trained in float8 by torchao's tensorwise, rowwise or
    rowwise_with_gw_hp recipe (an unnamed one: tensorwise, torchtitan's default) -> `--float8
    RECIPE`; "float8 all-gather" stated -> `--float8-all-gather`. MXFP8, NVFP4 and INT8 training
    stay not expressible.
 R17 stated length distributions (added 2026-12-07, with the multi-step replay). Where a row
    states its dataset's token lengths as a mean and a standard deviation ("3234+-2548 tokens")
    and truncates to a maximum, the run is a run of varying lengths, not R5's longest batch: a
    normal(mean, sd) over lengths 1.., each batch padded to the longest of its samples (the
    distribution of the maximum of `batch` draws), lengths above the maximum at the maximum, as
    a histogram of 64 equal bins plus the maximum -> `--seq-len-histogram` (gpumem's default
    100 steps, seed 0). Written after two trial estimates of rows 231-232 (to see the replay
    run on them); nothing in it (bins, steps, seed) was chosen by their figures.
 R18 PyTorch 1.x (added 2026-12-08, with `--keep-grads`). A row run before PyTorch 2.0 (March
    2023) — dated by its source column ("2022-12", "(2022)"), or by the page itself (the
    transformers single-GPU pages' nvidia-smi output reads January 2022, CUDA 11.2) — ran 1.x's
    defaults: `zero_grad()` zeroes the gradients and keeps them (`--keep-grads`; not under
    DeepSpeed, whose engine keeps its own), and torch.optim's optimizers run one parameter at a
    time (foreach became the default in 2.0: `adamw` -> `adamw-for-loop`).
 R19 stated CUDA context (added 2026-12-08). Where a row's source measures nvidia-smi and states
    the context its own run took before the model (the transformers pages: "GPU memory
    occupied: 1343 MB" after `torch.ones((1, 1)).to("cuda")`), the GPU's profile takes that
    context (`context_mib`): a fixed cost the source measured, nothing fitted.
 R15 accumulation (added 2026-12-07, with FSDP's `no_sync`). Stated ("grad accum N",
    "gradient_accumulation_steps N", "GA N") -> `--grad-accum N`; litgpt: its
    `gradient_accumulation_iters`, global_bs // (GPUs x micro-batch) where that is at least 1
    (else the config read at HEAD is not the run's: 1). Under FSDP each trainer's own way:
    torchtitan and torchtune reduce every micro-batch -> `--sync-each-batch`; Hugging Face's
    Trainer/accelerate and litgpt (Fabric) accumulate under `no_sync` -> gpumem's default.
"""
import csv
import math
import os
import re
import sys

CSV = os.environ.get("PUBLISHED_CSV", "/work/shared/data/published/published_runs_dev.csv")
OUT = os.path.join(os.path.dirname(__file__), "..", "data", "published", "jobs.toml")

HUB = {  # model column (lower-cased) -> Hub id with a config in data/hub-configs
    "llama 3.1 8b": "meta-llama/Llama-3.1-8B", "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama 3.1 8b instruct": "meta-llama/Llama-3.1-8B",  # same architecture keys (rule R6 note)
    "llama 3 8b": "meta-llama/Meta-Llama-3-8B", "llama3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B", "meta-llama-3-8b": "meta-llama/Meta-Llama-3-8B",
    "qwen3 8b (random init)": "Qwen/Qwen3-8B",
    "llama 3.1 70b": "meta-llama/Llama-3.1-70B", "llama 3.1 405b": "meta-llama/Llama-3.1-405B",
    "llama 3.3 70b instruct": "meta-llama/Llama-3.3-70B-Instruct",
    "llama-2-7b": "meta-llama/Llama-2-7b-hf", "llama2-7b": "meta-llama/Llama-2-7b-hf",
    "meta-llama/llama-2-70b-hf": "meta-llama/Llama-2-70b-hf",
    "falcon-7b": "tiiuae/falcon-7b", "gemma-2b": "google/gemma-2b", "gemma-7b": "google/gemma-7b",
    "gemma-2-2b": "google/gemma-2-2b", "gemma-2-9b": "google/gemma-2-9b",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B", "llama-3.2-3b": "meta-llama/Llama-3.2-3B",
    "mistral-7b-v0.2": "mistralai/Mistral-7B-Instruct-v0.2", "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "phi-2": "microsoft/phi-2", "phi-3-mini-4k-instruct": "microsoft/Phi-3-mini-4k-instruct",
    "stablelm-base-alpha-3b": "stabilityai/stablelm-base-alpha-3b",
    "tiny-llama": "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T",
    "tinyllama 1.1b (pretrain on tinystories)": "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T",
    "bigscience/t0_3b": "bigscience/T0_3B", "bigscience/mt0-xxl (12-13b)": "bigscience/mt0-xxl",
    "bigscience/bloomz-7b1": "bigscience/bloomz-7b1",
    "yi-6b-chat": "01-ai/Yi-6B-Chat", "yi-34b-chat": "01-ai/Yi-34B-Chat",
    "qwen/qwen2.5-14b": "Qwen/Qwen2.5-14B",
    "gpt2-large (762m)": "openai-community/gpt2-large", "gpt2-xl (1.5b, from config)": "openai-community/gpt2-xl",
    "microsoft/deberta-v2-xlarge-mnli (900m)": "microsoft/deberta-v2-xlarge-mnli",
    "facebook/blenderbot-400m-distill": "facebook/blenderbot-400M-distill",
}
REMOTE_CODE = ("qwen-1_8b-chat", "qwen-7b-chat", "qwen-14b-chat", "qwen-72b-chat", "chatglm3-6b",
               "baichuan2-7b-chat", "baichuan2-13b-chat")


def no(reason, detail=""):
    return {"status": "no", "reason": reason, "detail": detail}


def run(model, gpu, batch, measure, seq=None, precision="bf16", optimizer="adamw", lora=None,
        ckpt="off", strategy=None, world=None, extra=None, tags=(), grad_accum=None, capacity_gib=None):
    j = {"status": "run", "model": model, "gpu": gpu, "batch": int(batch), "measure": measure,
         "precision": precision, "optimizer": optimizer, "checkpointing": ckpt, "tags": list(tags)}
    if seq is not None:
        j["seq_len"] = int(seq)
    if lora:
        j["lora"] = lora
    if strategy:
        j["strategy"] = strategy
        j["world_size"] = int(world)
    if extra:
        j["extra"] = list(extra)
    if grad_accum:
        j["grad_accum"] = int(grad_accum)
    if capacity_gib is not None:
        j["capacity_gib"] = capacity_gib
    return j


def hub(row):
    return HUB.get(row["model"].strip().lower())


def float8(precision):
    """Rule R16: torchao's float8 recipe of the row's linears -> `--float8` flags; None where its
    low-precision training is another (MXFP8, NVFP4)."""
    p = precision.lower()
    if any(k in p for k in ("mxfp8", "nvfp4", "nocompile")):
        return None
    recipe = next((k for k in ("rowwise_with_gw_hp", "rowwise", "tensorwise") if k in p), "tensorwise")
    gather = recipe == "tensorwise" and ("float8 all-gather" in p or "f8 all-gather" in p)
    return ["--float8", recipe] + (["--float8-all-gather"] if gather else [])


def titan_compiles_loss(r):
    """R7: whether the row's torchtitan release compiled its loss, by the date the row states."""
    text = f"{r['source']} {r['other_settings']}"
    dated = re.search(r"\b(20\d\d)-(\d\d)\b", text) or re.search(r"dev(20\d\d)(\d\d)\d\d", text)
    if dated:
        month = dated.group(1) + "-" + dated.group(2)
        return "2024-10" <= month <= "2024-12" or month >= "2025-04"
    return any(int(y) >= 2026 for y in re.findall(r"\b(20\d\d)\b", text))


def torchtitan(n, r):
    p = r["precision"].lower()
    low = None
    if any(k in p for k in ("float8", "fp8", "nvfp4")):
        low = float8(p)
        if low is None:
            return no("low-precision-training", "MXFP8/NVFP4 linears (torchao) not modelled")
    if r["gpu"].startswith("MI300X"):
        return no("gpu-profile", "MI300X/ROCm: no profile")
    if "llama4" in r["model"].lower() or "moe" in r["source"]:
        return no("expert-parallel", "MoE with expert parallelism (torchtitan EP)")
    if "not stated" in r["model"].lower():
        return no("vague", "model and batch not stated")
    m = hub(r)
    if m is None:
        return no("vague", "custom model config not published in the row")
    ck = r["checkpointing"].lower()
    ck = "selective-op" if ("sac" in ck or "selective" in ck) else ("full" if ck == "full" else "off")
    gpu = "h100-80gb-sxm" if r["gpu"].startswith("H100") else ("h200" if "H200" in r["gpu"] else "h200")
    tags = ["framework-model", "compile"]
    if gpu == "h200" and "H200" not in r["gpu"]:
        tags.append("gpu-substitute")
    if "not stated" in r["checkpointing"]:
        tags.append("ac-not-stated")
    return run(m, gpu, r["micro_batch"], "reserved", seq=r["seq_len"], precision="fp32",
               ckpt=ck, strategy="fsdp", world=r["n_gpus"],
               extra=["--fsdp-param-dtype", "bf16"] + (["--compile"] if titan_compiles_loss(r) else []) + (low or []),
               tags=tags)


def torchao(n, r):
    if "torchtitan" in r["strategy"] or "FSDP" in r["strategy"]:
        return torchtitan(n, r)
    opt = r["optimizer"]
    if r["model"].startswith("timm ViT-H/14"):
        if "ao " in opt or "lpmm" in opt:
            return no("low-bit-optimizer", f"{opt} (torchao/lpmm low-bit optimizer)")
        o = "adamw8bit" if "bnb" in opt else "adamw"
        return run("timm:vit_huge_patch14_224", "rtx4090", r["micro_batch"], "allocated", precision="amp-bf16",
                   optimizer=o, tags=["compile", "gpu-substitute"])
    if "INT8" in r["precision"]:
        return no("low-precision-training", "INT8 quantized training (torchao)")
    if "custom" in r["model"] or "from scratch" in r["model"]:
        return no("vague", "custom 1B Llama2 config not stated in the row")
    return no("vague", "batch size, length and checkpointing not stated")


def torchtune(n, r):
    s = r["strategy"]
    if "README" in r["source"]:
        if "Full finetune" in s and "single" not in s:
            return no("optimizer-in-backward", "full FT with CPU offload and fused optimizer step in backward")
        m = hub(r)
        gpu = {"RTX 4090": "rtx4090", "A6000": None, "A100": "a100-80gb"}.get(r["gpu"])
        if gpu is None:
            return no("gpu-profile", "RTX A6000: no profile")
        # torchtune's llama3_1 configs of 2024-09 train with CEWithChunkedOutputLoss (8 chunks).
        chunked = ["--chunked-ce", "8", "--compile"]  # R7: torchtune's compile_loss
        if "Full finetune" in s:
            # 8B_full_single_device: bnb PagedAdamW8bit stepped in backward, AC on.
            return run(m, gpu, r["micro_batch"], "reserved", seq=r["seq_len"], ckpt="full", optimizer="paged-adamw8bit",
                       extra=chunked + ["--optimizer-in-backward"],
                       tags=["framework-model", "compile", "config-inferred", "chunked-ce"])
        # torchtune llama3_1 LoRA configs of 2024-09: q,v,output_proj + MLP LoRA r8 a16, AC on
        quant = ",quant=nf4,double_quant=false" if "QLoRA" in s else ""
        lora = "r=8,alpha=16,targets=q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj" + quant
        tags = ["framework-model", "compile", "config-inferred", "chunked-ce"]
        if "FSDP2" in s:
            return run(m, gpu, r["micro_batch"], "reserved", seq=r["seq_len"], lora=lora, ckpt="full",
                       strategy="fsdp", world=r["n_gpus"], extra=chunked, tags=tags)
        return run(m, gpu, r["micro_batch"], "reserved", seq=r["seq_len"], lora=lora, ckpt="full", extra=chunked, tags=tags)
    # lora_finetune.rst / qlora: Llama-2-7B, alpaca, batch 2, max_seq_len None -> longest alpaca sample
    o = r["other_settings"]
    rank = re.search(r"rank (\d+)", o)
    rank = int(rank.group(1)) if rank else 8
    if "QLoRA" in s:
        lora = f"r={rank},alpha={2*rank},targets=q_proj,v_proj,o_proj,quant=nf4,double_quant=false"
    elif "Q and V only" in o:
        lora = f"r={rank},alpha={2*rank},targets=q_proj,v_proj"
    else:
        lora = f"r={rank},alpha={2*rank},targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head"
    # alpaca_cleaned without max_seq_len: the longest batch's length is not stated -> 512 assumed
    tags = ["framework-model", "varlen", "gpu-substitute", "length-assumed"] + (["config-inferred"] if "QLoRA" in s else [])
    return run(hub(r), "a100-80gb", r["micro_batch"], "reserved", seq=512, lora=lora, ckpt="full", tags=tags)


def peft(n, r):
    m, s = r["model"], r["strategy"]
    if "stable-diffusion" in m or "FLUX" in m:
        return no("diffusion-pipeline", "diffusers pipeline (UNet/DiT + text encoder + VAE)")
    if "T0_3B" in m or "mt0" in m or "bloomz" in m:
        mid = hub(r)
        meas = "allocated"
        if r["what_measured"].startswith("OOM"):
            meas = "oom"
        # PEFT README script: batch 8, inputs padded to max_length 64 (examples/*ds_zero3_offload.py)
        tags = ["varlen", "length-assumed"]
        if "ZeRO-3" in s:
            return run(mid, "a100-80gb", 8, meas, seq=64, precision="fp32", lora="r=8,alpha=32,dropout=0.1,targets=q,v" if "bloomz" not in m else "r=8,alpha=32,dropout=0.1,targets=query_key_value",
                       strategy="zero3", world=1, extra=["--deepspeed", "data/published/zero3_offload.json"], tags=tags)
        if "LoRA" in s:
            t = "query_key_value" if "bloomz" in m else "q,v"
            return run(mid, "a100-80gb", 8, meas, seq=64, precision="fp32", lora=f"r=8,alpha=32,dropout=0.1,targets={t}", tags=tags)
        return run(mid, "a100-80gb", 8, meas, seq=64, precision="fp32", tags=tags)
    if "Llama-2-70b" in m:
        if "range" in r["notes"] or "another GPU" in r["notes"]:
            return no("vague", r["notes"])
        if "ZeRO-3 + QLoRA" in s:
            return run("meta-llama/Llama-2-70b-hf", "a100-40gb", 2, "nvidia-smi", seq=2048,
                       lora="r=8,alpha=16,targets=all-linear,quant=nf4", ckpt="full", strategy="zero3", world=2,
                       tags=["quant-storage-bf16", "gpu-substitute"])
        if "QLoRA + CPU param offload" in s:
            return run("meta-llama/Llama-2-70b-hf", "rtx3090", 2, "nvidia-smi", seq=2048,
                       lora="r=8,alpha=16,targets=all-linear,quant=nf4", ckpt="full", strategy="fsdp", world=2,
                       extra=["--fsdp-cpu-offload"], tags=["fsdp1", "quant-storage-bf16", "gpu-substitute"])
        return run("meta-llama/Llama-2-70b-hf", "h100-80gb-sxm", 8, "nvidia-smi", seq=2048,
                   lora="r=8,alpha=16,targets=all-linear", ckpt="full", strategy="zero3", world=8, tags=[])
    return no("vague", "")


def hf_docs(n, r):
    o = r["other_settings"]
    ga = int(re.search(r"grad_accum (\d+)", o).group(1))
    prec = "amp-fp16" if "fp16" in r["precision"] else "fp32"
    opt = r["optimizer"]
    # R4: the Trainer's default optim of the time, adamw_hf (the row's settings name it).
    opt = "adafactor" if "Adafactor" in opt else ("adam8bit" if "8bit" in opt else "transformers-adamw")
    ck = "full" if r["checkpointing"] == "on" else "off"
    j = run("hf:BertForSequenceClassification@google-bert/bert-large-uncased", "v100-16gb", r["micro_batch"],
            "nvidia-smi", seq=512, precision=prec, optimizer=opt, ckpt=ck, grad_accum=ga, tags=["after-train"])
    j["context_mib"] = 1343  # R19
    return j


def unsloth(n, r):
    s = r["strategy"]
    if "nsloth" in s:
        return no("unsloth-kernels", "unsloth's Triton kernels and offloaded gradient checkpointing")
    if r["what_measured"].startswith("OOM boundary: max context"):
        m = hub(r)
        cap = int(re.search(r"(\d+) GB", r["what_measured"]).group(1))
        gpu = "a100-80gb" if "A100" in r["gpu"] else "a10"
        # HF + FA2 QLoRA baseline of unsloth's table: gradient checkpointing on (use_reentrant), r=32 all linear
        return run(m, gpu, 1, "boundary", seq=r["seq_len"], lora="r=32,alpha=32,targets=all-linear,quant=nf4",
                   ckpt="full", optimizer="adamw8bit", capacity_gib=cap, tags=["gpu-substitute", "config-inferred"])
    if "LLaMA-Factory" in r["source"]:
        quant = ",quant=nf4" if "QLoRA" in s else ""
        return run("meta-llama/Llama-2-7b-hf", "a100-80gb", r["micro_batch"], "nvidia-smi", seq=r["seq_len"],
                   lora="r=8,alpha=16,targets=q_proj,v_proj" + quant, grad_accum=2, tags=["config-inferred", "varlen"])
    return no("vague", "settings only in linked Colab notebooks")


# R6: the litgpt config of each row's checkpoint (config_hub/finetune/<dir>/*.yaml's checkpoint_dir).
LITGPT_NAMES = {
    "falcon-7b": "falcon-7b", "gemma-2-2b": "Gemma-2-2b", "gemma-2-9b": "Gemma-2-9b", "gemma-2b": "Gemma-2b",
    "gemma-7b": "Gemma-7b", "llama-2-7b": "Llama-2-7b-hf", "llama-3-8b": "Llama-3-8B",
    "llama-3.1-8b": "Llama-3.1-8B", "llama-3.2-1b": "Llama-3.2-1B", "llama-3.2-3b": "Llama-3.2-3B",
    "mistral-7b": "Mistral-7B-v0.1", "mistral-7b-v0.2": "Mistral-7B-v0.2", "phi-2": "phi-2",
    "phi-3-mini-4k-instruct": "Phi-3-mini-4k-instruct", "stablelm-base-alpha-3b": "stablelm-base-alpha-3b",
    "tiny-llama": "tiny-llama-1.1b", "tinyllama 1.1b (pretrain on tinystories)": "tiny-llama-1.1b",
}


def litgpt_lora_targets(o):
    """The row's LoRA in litgpt's own names (its Config's lora_* switches)."""
    d = dict(re.findall(r"'lora_(\w+)': (True|False)", o))
    t = [k for k in ("query", "key", "value", "projection", "mlp", "head") if d.get(k) == "True"]
    rr = int(re.search(r"'lora_r': (\d+)", o).group(1))
    a = int(re.search(r"'lora_alpha': (\d+)", o).group(1))
    dropout = re.search(r"'lora_dropout': ([0-9.]+)", o)
    drop = f",dropout={dropout.group(1)}" if dropout and float(dropout.group(1)) > 0 else ""
    return f"r={rr},alpha={a}{drop},targets=" + ",".join(t)


def litgpt(n, r):
    s, o = r["strategy"], r["other_settings"]
    m = "litgpt:" + LITGPT_NAMES[r["model"].strip().lower()]
    if "thunder" in r["source"]:
        if "Thunder" in o:
            return no("thunder-compiler", "Lightning Thunder executors (nvFuser, torch.compile)")
        st = None
        if "FSDP" in s:
            st = "fsdp"
        elif "DDP" in s:
            st = "ddp"
        # litgpt pretrain.py's step: the whole logits, cross-entropy in chunks (R6).
        return run(m + "(lm_head_chunk_size=0)", "a100-40gb", r["micro_batch"], "allocated", seq=2048,
                   precision="bf16", ckpt="off", strategy=st, world=r["n_gpus"] if st else None,
                   tags=["fsdp1"] if st == "fsdp" else [])
    meas = "oom" if r["what_measured"].startswith("OOM") else "allocated"
    tags = ["varlen", "whole-run"]
    qlora = "nf4" in r["precision"]
    # R2: Fabric's quantizer, on the bitsandbytes litgpt pinned through 2024 for rows of 2024.
    pinned = ",bnb=0.42" if "(2024-" in r["source"] else ""
    quant = ",quant=nf4,double_quant=false,loader=fabric" + pinned if qlora else ""
    lora = litgpt_lora_targets(o) + quant if "lora" in s else None
    gpu = "a10"  # A10G 24GB (config_hub README's GPU)
    # R15: litgpt's gradient_accumulation_iters.
    stated = re.search(r"global_bs (\d+), mbs (\d+)", o)
    accum = int(stated.group(1)) // (int(r["n_gpus"]) * int(stated.group(2))) if stated else 0
    accum = accum if accum > 1 else None
    if "FSDP" in s:
        return run(m, gpu, r["micro_batch"], meas, seq=512, ckpt="full", strategy="fsdp", world=r["n_gpus"],
                   tags=tags + ["fsdp1"], grad_accum=accum)
    return run(m, gpu, r["micro_batch"], meas, seq=512, lora=lora, ckpt="off",
               optimizer="paged_adamw_32bit" if qlora else "adamw", tags=tags, grad_accum=accum)


def swift(n, r):
    m = r["model"].lower()
    if r["measured_gib"] == "":
        return no("no-figure", "no figure published for this row")
    if "Megatron" in r["strategy"]:
        return no("tensor-parallel", "Megatron-LM TP/SP/EP")
    if r["model"] == "Qwen/Qwen2.5-14B":
        if "at capacity" in r["what_measured"]:
            return no("vague", "figure capped at the device's capacity")
        return run("Qwen/Qwen2.5-14B", "a100-80gb", 1, "reserved", seq=8192, ckpt="full", strategy="zero3", world=8,
                   grad_accum=2, tags=["gpu-substitute", "whole-run"])
    if m in REMOTE_CODE:
        # gpumem runs such code (`hf-code:`), but data/hub-configs holds the configs alone.
        return no("remote-code-model", "architecture only in the checkpoint's own code (trust_remote_code; "
                  "gpumem runs it as hf-code:, but its modeling files are not in data/hub-configs)")
    if r["n_gpus"] == "2":
        return no("device-map-split", "naive model parallelism (device_map over 2 GPUs)")
    if "openbuddy" in m:
        return no("config-unavailable", "published config.json not found for this evaluation")
    full = "full" in r["strategy"]
    lora = None if full else "r=8,alpha=32,dropout=0.05,targets=q_proj,k_proj,v_proj"  # swift 1.x DEFAULT for llama-arch
    return run(hub(r), "a100-80gb", r["micro_batch"], "reserved", seq=r["seq_len"], lora=lora,
               ckpt="full" if r["checkpointing"] == "on" else "off", grad_accum=16,
               tags=["varlen", "whole-run", "gpu-substitute"])


def blog(n, r):
    m = hub(r)
    s = r["strategy"]
    if "CPU offload" in s and "FSDP" in s:
        extra = ["--fsdp-cpu-offload"]
    else:
        extra = []
    if m is None:
        return no("vague", "")
    seq = re.match(r"\D*(\d+)", r["seq_len"])
    seq = 128 if "gpt2-large" in r["model"] else int(seq.group(1))
    prec = "amp-fp16" if "fp16" in r["precision"].lower() or "FP16" in s else "fp32"
    if "DeepSpeed ZeRO-2" in s:
        st = "zero2"
    elif "ZeRO-3" in s:
        return run(m, "rtx3090", r["micro_batch"], "fits", seq=seq, precision="fp16", strategy="zero3", world=2,
                   extra=["--deepspeed", "data/published/zero3_offload.json"], tags=["gpu-substitute", "length-assumed"])
    elif "FSDP" in s:
        st = "fsdp"
    else:
        st = "ddp"
    tags = ["gpu-substitute"] + (["fsdp1"] if st == "fsdp" else []) + (["length-assumed"] if "gpt2-large" in r["model"] else [])
    if st.startswith("zero"):
        prec = "fp16"
    return run(m, "rtx3090", r["micro_batch"], "fits", seq=seq, precision=prec, strategy=st, world=2,
               extra=extra, tags=tags)


def axolotl(n, r):
    return no("vague", "requirement statement, yaml not pinned")


def mapping(n, r):
    src = r["source"]
    for key, f in (("pytorch/torchtitan", torchtitan), ("pytorch/ao", torchao), ("pytorch/torchtune", torchtune),
                   ("huggingface/peft", peft), ("huggingface/transformers", hf_docs), ("unslothai", unsloth),
                   ("litgpt", litgpt), ("ms-swift", swift), ("huggingface/blog", blog), ("axolotl", axolotl)):
        if key in src:
            return lengths(accumulation(attention(f(n, r), r), r, key), r)
    return no("vague", "unknown source")


FLASH_GPUS = ("a100", "a10", "h100", "h200", "rtx3090", "rtx4090", "l4", "l40")  # Ampere and newer
PRE_SDPA = re.compile(r"v4\.([0-2]x|[0-2]\d|3[0-5])\b|\b20(1\d|2[0-3])\b")


def attention(job, r):
    """Rule R13: the attention implementation the row's run had."""
    if job["status"] != "run" or "framework-model" in job["tags"]:
        return job
    text = " ".join(r[k] for k in ("strategy", "other_settings", "notes")).lower()
    half = job["precision"] in ("bf16", "fp16", "amp-bf16", "amp-fp16")
    if re.search(r"flash[-_ ]?attn|\bfa2\b|flash[-_ ]attention", text):
        if half and job["gpu"].startswith(FLASH_GPUS):
            job.setdefault("extra", []).extend(["--attention", "flash"])
    elif PRE_SDPA.search(r["source"]):
        job.setdefault("extra", []).extend(["--attention", "eager"])
    return job


ACCUM = re.compile(r"(?:grad(?:ient)?[ _]acc(?:um(?:ulation)?)?(?:[ _]steps)?|\bGA)\s*[:=]?\s*(\d+)", re.I)


def accumulation(job, r, source):
    """Rule R15: the row's gradient accumulation, and how its trainer accumulates under FSDP."""
    if job["status"] != "run":
        return job
    if "grad_accum" not in job:
        m = ACCUM.search(" ".join(r[k] for k in ("strategy", "other_settings", "notes")))
        if m and int(m.group(1)) > 1:
            job["grad_accum"] = int(m.group(1))
    if job.get("grad_accum", 1) > 1 and job.get("strategy") == "fsdp" and source in (
        "pytorch/torchtitan", "pytorch/torchtune", "pytorch/ao"
    ):
        job.setdefault("extra", []).append("--sync-each-batch")
    return job


STATED_LENGTHS = re.compile(r"(\d+)\s*(?:\+-|\+/-|±)\s*(\d+)\s*tokens")


def lengths(job, r, bins=64):
    """Rule R17: a stated mean +- sd of the dataset's lengths -> the histogram of each batch's
    padded length, `seq_len_histogram = [[length, weight], ...]` (weights in millionths)."""
    m = STATED_LENGTHS.search(r["other_settings"])
    if job["status"] != "run" or not m or "seq_len" not in job:
        return job
    mean, sd, cap, batch = int(m.group(1)), int(m.group(2)), job["seq_len"], job["batch"]

    def normal(x):
        return 0.5 * (1 + math.erf((x - mean) / (sd * math.sqrt(2))))

    lo = normal(1)

    def cdf(x):  # P(a batch's longest sample <= x), the normal cut to lengths of at least 1
        return (max(normal(x) - lo, 0.0) / (1 - lo)) ** batch

    edges = [1 + (cap - 1) * i / bins for i in range(bins + 1)]
    hist = [[round((a + b) / 2), round((cdf(b) - cdf(a)) * 1e6)] for a, b in zip(edges, edges[1:])]
    hist.append([cap, round((1 - cdf(cap)) * 1e6)])
    job["seq_len_histogram"] = [h for h in hist if h[1] > 0]
    del job["seq_len"]
    return job


# R18: runs dated by their page rather than their source column.
RUN_DATES = {"huggingface/transformers": (2022, 1)}
TORCH_2 = (2023, 3)


def torch1(j, r):
    """Rule R18: a row run before PyTorch 2.0 with 1.x's zero_grad and optimizer defaults."""
    src = r["source"].split()[0].replace("github:", "")
    m = re.search(r"\((?:[^()]*\D)?(20\d\d)(?:-(\d\d))?\)", r["source"])
    date = next((d for k, d in RUN_DATES.items() if src.startswith(k)), None)
    if date is None and m:
        date = (int(m.group(1)), int(m.group(2) or 12))
    if j.get("status") != "run" or date is None or date >= TORCH_2:
        return j
    if j.get("strategy", "").startswith("zero") or "--deepspeed" in j.get("extra", []):
        return j
    j["keep_grads"] = True
    if j["optimizer"] in ("adam", "adamw", "sgd", "sgd-momentum"):
        j["optimizer"] += "-for-loop"
    return j


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def main():
    rows = list(csv.DictReader(open(CSV, newline="")))
    out = ["# gpumem jobs of the published dev rows: written by scripts/published-jobs.py (its docstring",
           "# states the mapping rules R1-R19). `line` is the row's line in published_runs_dev.csv;",
           "# `status = \"no\"` rows carry the missing mechanism as `reason`.", ""]
    for i, r in enumerate(rows):
        n = i + 2
        j = torch1(mapping(n, r), r)
        key = re.sub(r"[^a-z0-9]+", "-", (r["source"].split()[0].split("/")[-1] + "-" + r["model"]).lower())[:48].strip("-")
        out.append("[[row]]")
        out.append(f"line = {n}")
        out.append(f"key = {toml_value(key)}")
        for k, v in j.items():
            if v is None or v == [] or v == "":
                continue
            out.append(f"{k} = {toml_value(v)}")
        out.append("")
    with open(OUT, "w") as f:
        f.write("\n".join(out))
    print(f"wrote {OUT}: {len(rows)} rows", file=sys.stderr)


if __name__ == "__main__":
    main()
