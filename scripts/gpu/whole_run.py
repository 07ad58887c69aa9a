"""A fine-tune's whole run, for real, as its users run it: transformers' `from_pretrained` from a
local checkpoint (bitsandbytes 4-bit for QLoRA), PEFT's LoRA, Hugging Face's Trainer for the
steps and its evaluation loop, and the Trainer's checkpoint save. Prints one JSON object per
part: PyTorch's most reserved and allocated in it (`torch.cuda.reset_peak_memory_stats` at
each part's start) and, at its end, what the device has in use (NVML, as nvidia-smi shows it).

  python scripts/gpu/whole_run.py make-checkpoint DIR MODEL.json     # fake weights, on disk
  python scripts/gpu/whole_run.py run DIR JOB.json                   # one process per job
  python scripts/gpu/whole_run.py context                            # memory outside the allocator

The figures are set beside `gpumem estimate … --whole-run` of the same jobs
(scripts/gpu/whole-run-h200.sh). Never run by the tests: it needs a GPU.
"""

import json
import os
import subprocess
import sys
import time

import torch


def make_checkpoint(directory, model_json):
    """Writes a config and safetensors shards of small random weights: what `from_pretrained`
    reads, shard by shard, for a model of that shape (never downloaded weights)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = json.loads(model_json)
    config = AutoConfig.for_model(**spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    os.makedirs(directory, exist_ok=True)
    config.save_pretrained(directory)
    state = {k: v for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    shard_limit = 2 << 30
    shards, current, size = [], {}, 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > shard_limit:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    shards.append(current)
    weight_map, total = {}, 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(0)
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        real = {}
        for name, t in shard.items():
            # Norm weights 1, the rest small and random: the values do not bear on memory.
            if name.endswith("norm.weight"):
                real[name] = torch.ones(t.shape, dtype=t.dtype)
            else:
                real[name] = (
                    torch.randn(t.shape, dtype=torch.float32, device=device, generator=generator)
                    .mul_(0.02)
                    .to(t.dtype)
                    .cpu()
                )
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        save_file(real, os.path.join(directory, fname), metadata={"format": "pt"})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    print(json.dumps({"checkpoint": directory, "shards": len(shards), "bytes": total}))


GPU = torch.cuda.is_available()  # without one (a dry run of the flow on the CPU) the figures are 0


def nvml_used():
    if not GPU:
        return 0
    try:
        return int(torch.cuda.device_memory_used())
    except Exception:  # noqa: BLE001 - an old torch or no NVML: say so in the row
        free, total = torch.cuda.mem_get_info()
        return int(total - free)


class Parts:
    def __init__(self, job):
        self.job = job
        self.started = None

    def begin(self, name):
        if GPU:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.name, self.started = name, time.time()

    def end(self, **extra):
        cuda = torch.cuda
        if GPU:
            cuda.synchronize()
        row = {
            "job": self.job,
            "part": self.name,
            "max_reserved": cuda.max_memory_reserved() if GPU else 0,
            "max_allocated": cuda.max_memory_allocated() if GPU else 0,
            "reserved_end": cuda.memory_reserved() if GPU else 0,
            "allocated_end": cuda.memory_allocated() if GPU else 0,
            "device_used_end": nvml_used(),
            "seconds": round(time.time() - self.started, 2),
        }
        row.update(extra)
        print(json.dumps(row), flush=True)
        return row


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seq, vocab):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def run(directory, job_json):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainingArguments

    job = json.loads(job_json)
    name = job["name"]
    parts = Parts(name)
    if GPU:
        torch.zeros(1, device="cuda")  # the context, before any part
    baseline = nvml_used()

    parts.begin("load")
    kwargs = {"dtype": torch.bfloat16, "device_map": {"": 0 if GPU else "cpu"}}
    if job.get("quant") and GPU:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=job["quant"],
            bnb_4bit_use_double_quant=job.get("double_quant", True),
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    model = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    loaded = parts.end(context_bytes=baseline)

    parts.begin("prepare")
    if job.get("quant") and GPU:
        model = prepare_model_for_kbit_training(model)
    elif job.get("checkpointing"):
        model.gradient_checkpointing_enable()
    lora = LoraConfig(
        r=job["r"],
        lora_alpha=job["alpha"],
        lora_dropout=job.get("dropout", 0.0),
        target_modules=job["targets"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    dtypes = {}
    for p in model.parameters():
        key = f"{p.dtype}{'/trainable' if p.requires_grad else ''}"
        dtypes[key] = dtypes.get(key, 0) + p.numel() * p.element_size()
    # Which torch.utils.checkpoint call the layers make (reentrant or not is in its keywords).
    ckpt = [
        repr(m._gradient_checkpointing_func)
        for m in model.modules()
        if hasattr(m, "_gradient_checkpointing_func")
    ]
    parts.end(parameter_bytes_by_dtype=dtypes, checkpoint_function=ckpt[:1])
    del loaded

    vocab = model.config.vocab_size
    batch, seq = job["batch"], job["seq"]
    train = Tokens(batch * job.get("steps", 3) * job.get("grad_accum", 1), seq, vocab)
    evaluation = Tokens(job["eval_batch"] * job["eval_batches"], seq, vocab)
    args = TrainingArguments(
        output_dir=os.path.join(directory, "out-" + name),
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=job["eval_batch"],
        max_steps=job.get("steps", 3),
        gradient_accumulation_steps=job.get("grad_accum", 1),
        bf16=GPU,
        use_cpu=not GPU,
        optim=job.get("optim", "adamw_torch"),
        learning_rate=1e-4,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        dataloader_num_workers=0,
        remove_unused_columns=False,
    )

    def metrics(prediction):
        return {"n": float(len(prediction.predictions))}

    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        compute_metrics=metrics if job.get("eval_logits", True) else None,
    )

    parts.begin("train")
    trainer.train()
    parts.end()

    # The first evaluation is the run's; the others start with its cache (their rows say so).
    for i, accumulation in enumerate(job.get("eval_accumulation", [None])):
        trainer.args.eval_accumulation_steps = accumulation
        parts.begin("evaluate" if i == 0 else f"evaluate-acc{accumulation}")
        try:
            trainer.evaluate()
            parts.end(eval_accumulation_steps=accumulation)
        except torch.OutOfMemoryError as e:  # the figure is then "more than the GPU"
            parts.end(eval_accumulation_steps=accumulation, oom=str(e).splitlines()[0])
            torch.cuda.empty_cache()

    parts.begin("save")
    trainer._save_checkpoint(trainer.model, trial=None)
    parts.end()


def context():
    """What the device holds outside PyTorch's allocator as a fine-tune's libraries come in,
    one step at a time — the fixed cost a profile's context is — in each sense of "in use":
    NVML's used (``torch.cuda.device_memory_used``, which counts the driver's reserved memory),
    ``mem_get_info``'s total − free, and nvidia-smi's used and reserved."""

    def point(name):
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        smi = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=memory.used,memory.reserved",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
        ).stdout.strip()
        row = {
            "at": name,
            "nvml_used": nvml_used(),
            "total_minus_free": total - free,
            "reserved": torch.cuda.memory_reserved(),
            "nvidia_smi_used_reserved_mib": smi,
        }
        print(json.dumps(row), flush=True)

    torch.zeros(1, device="cuda")
    point("torch context")
    import transformers  # noqa: F401

    point("import transformers")
    import bitsandbytes as bnb

    point("import bitsandbytes")
    import peft  # noqa: F401

    point("import peft")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    (a @ a).sum().backward()
    point("bf16 matmul forward and backward")
    layer = bnb.nn.Linear4bit(
        4096, 4096, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4"
    ).cuda()
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()
    point("Linear4bit forward and backward")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = torch.nn.functional.linear(x.float(), a.float())
    torch.nn.functional.cross_entropy(
        logits.float(), torch.zeros(8, dtype=torch.long, device="cuda")
    ).backward()
    point("autocast, cross-entropy")
    opt = bnb.optim.AdamW8bit([torch.nn.Parameter(torch.randn(4096, 4096, device="cuda"))])
    opt.param_groups[0]["params"][0].grad = torch.randn(4096, 4096, device="cuda")
    opt.step()
    point("AdamW8bit step")


if __name__ == "__main__":
    if sys.argv[1] == "make-checkpoint":
        make_checkpoint(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "context":
        context()
    else:
        sys.exit(f"unknown command {sys.argv[1]!r}")
