"""Runs a job's training step on a CUDA GPU, as the tracer's loop does on its meta device, and
saves PyTorch's own memory snapshot (``torch.cuda.memory._snapshot()``) for ``gpumem diff``:

    python -m gpumem_trace.record MODEL --batch N [--optimizer adam] [--precision fp32]
        [--input CxHxW] [--seq-len S] [--iterations 3] [--benchmark]
        [--checkpointing [--selective]] [--lora-rank R --lora-targets T [--lora-alpha A]] --out snap.pickle

The loop: LoRA applied as the tracer applies it (gpumem_trace.lora, PEFT's layout), the model
moved to the GPU, checkpointing switched on as the tracer does, the optimizer made; per
iteration the new batch moved to the GPU, ``zero_grad(set_to_none=True)``, forward and loss
under autocast, backward (through GradScaler for amp-fp16), ``step``. Prints one JSON line: PyTorch's peaks and the device memory
in use at the end (what nvidia-smi shows). Exit codes: 0 saved; 2 bad model or option; 3 no
CUDA device or the model failed.
"""

import argparse
import json
import pickle
import sys

import torch

from . import ac, lora
from .loop import PRECISIONS, enable_checkpointing, make_optimizer
from .models import ReferenceError_, outputs_in_fp32, resolve
from .request import lora_document


def batch_on_gpu(specs, weights_dtype, channels_last, device="cuda"):
    """Random inputs; integer tensors (labels, token ids) are zeros, valid for any class count."""
    out = []
    for shape, dtype in specs:
        if dtype.is_floating_point:
            out.append(torch.randn(shape, dtype=weights_dtype or dtype, device=device))
        else:
            out.append(torch.zeros(shape, dtype=dtype, device=device))
    if channels_last and out[0].dim() == 4:
        out[0] = out[0].to(memory_format=torch.channels_last)
    return out


def materialise(model, weights_dtype, device="cuda"):
    """A model built without weights (meta device or skipped init) made real on the GPU, with
    each layer's own initialisation where it has one."""
    if any(t.device.type == "meta" for t in model.parameters()) or any(
        t.device.type == "meta" for t in model.buffers()
    ):
        model.to_empty(device=device)
    else:
        model.to(device)
    for m in model.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            try:
                with torch.no_grad():
                    reset()
            except Exception:  # noqa: BLE001 - a layer whose reset needs more than it has; values do not decide memory
                pass
    if weights_dtype is not None:
        model.to(weights_dtype)


def record(a, device="cuda"):
    """Runs the loop on ``device`` (a CPU run checks the loop; only CUDA has a snapshot)."""
    cuda = device == "cuda"
    job = resolve(a.model, input_shape=a.input_shape, seq_len=a.seq_len, batch_hint=a.batch)
    autocast_dtype, weights_dtype = PRECISIONS[a.precision]
    torch.backends.cudnn.benchmark = a.benchmark
    if cuda:
        # Python stacks make the file ~50x larger; the sizes and order are what diff needs.
        torch.cuda.memory._record_memory_history(
            context="alloc" if a.stacks else None, stacks="python", max_entries=a.max_entries
        )
    model = job.model
    doc = lora_document(a)
    adapters = doc and lora.Lora.from_document(doc)
    if adapters is not None:
        lora.apply(model, adapters, a.model)
    materialise(model, weights_dtype, device)
    # Real autocast: checkpoint's recomputation re-enters it by itself.
    enable_checkpointing(model, a.model, ac.mode_of(a.checkpointing, a.selective))
    if a.channels_last:
        model.to(memory_format=torch.channels_last)
    model.train()
    optimizer = make_optimizer(
        a.optimizer, [p for p in model.parameters() if p.requires_grad], 1e-3
    )
    scaler = torch.amp.GradScaler("cuda") if a.precision == "amp-fp16" else None
    keep_outputs = job.keeps_outputs if a.outputs is None else a.outputs == "kept"
    outputs_fp32 = job.returns_fp32_outputs(keep_outputs, a.precision)
    batch = outputs = loss = None
    for _ in range(a.iterations):
        batch = None  # the loop head rebinds the batch: the old one dies first
        batch = batch_on_gpu(job.batch_specs(a.batch), weights_dtype, a.channels_last, device)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            outputs = job.forward(model, batch)
            if outputs_fp32:  # as the Trainer's accelerate returns them
                outputs = outputs_in_fp32(outputs)
            loss = job.loss(outputs, batch)
        if not keep_outputs:
            outputs = None
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    if not cuda:
        return None
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    traced = sum(len(t) for t in snap.get("device_traces", []))
    if traced >= a.max_entries:
        # The history is a ring: its oldest entries are gone, and a diff would part early.
        print(
            f"gpumem_trace.record: the allocator's history filled its {a.max_entries} entries; raise --max-entries",
            file=sys.stderr,
        )
    free, total = torch.cuda.mem_get_info()
    facts = {
        "model": a.model,
        "batch": a.batch,
        "optimizer": a.optimizer,
        "precision": a.precision,
        "seq_len": a.seq_len,
        "checkpointing": ac.mode_of(a.checkpointing, a.selective),
        "lora_rank": a.lora_rank,
        "lora_targets": a.lora_targets,
        "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(),
        "device_used_end": total - free,
        "torch": str(torch.__version__),
        "cudnn": torch.backends.cudnn.version() or 0,
        "gpu": torch.cuda.get_device_name(0),
        "iterations": a.iterations,
    }
    snap["gpumem"] = facts  # what was run, beside PyTorch's own keys
    with open(a.out, "wb") as f:
        pickle.dump(snap, f)
    return facts


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpumem_trace.record", description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--precision", default="fp32", choices=sorted(PRECISIONS))
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--input")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--outputs", choices=["kept", "dropped"])
    ac.add_flags(p)
    p.add_argument(
        "--lora-rank", type=int, help="LoRA fine-tuning: the rank r (with --lora-targets)"
    )
    p.add_argument("--lora-alpha", type=float, default=8.0)
    p.add_argument("--lora-targets", help="module names, comma-separated, or all-linear")
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--benchmark", action="store_true", help="torch.backends.cudnn.benchmark = True")
    p.add_argument(
        "--stacks",
        action="store_true",
        help="record each allocation's Python stack (for pytorch.org/memory_viz)",
    )
    p.add_argument("--max-entries", type=int, default=1_000_000)
    a = p.parse_args(argv)

    def fail(code, msg):
        print(f"gpumem_trace.record: {msg}", file=sys.stderr)
        return code

    a.input_shape = None
    if a.input:
        try:
            a.input_shape = tuple(int(x) for x in a.input.lower().split("x"))
        except ValueError:
            return fail(2, f"--input `{a.input}` is not CxHxW")
    if a.batch < 1 or a.iterations < 1:
        return fail(2, "--batch and --iterations must be at least 1")
    try:
        lora_document(a)  # checked before the GPU is asked for
    except ValueError as e:
        return fail(2, str(e))
    if not torch.cuda.is_available():
        return fail(3, "no CUDA device (record runs the step on a GPU)")
    try:
        facts = record(a)
    except ReferenceError_ as e:
        return fail(2, str(e))
    except Exception as e:  # noqa: BLE001 - the model's own failure
        return fail(
            3, f"{a.model} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        )
    print(json.dumps(facts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
