"""gpumem's FSDP2 rank estimate beside PyTorch's own FSDPMemTracker, on the same configurations.

FSDPMemTracker (torch.distributed._tools.fsdp2_mem_tracker) counts the live tensor bytes of one
rank, by FSDP category, while the step runs; here it runs as its authors test it without GPUs:
a fake process group and FakeTensorMode (on the CPU device, so attention takes the CPU's
kernels). gpumem traces the same model, batch and wrapping (fully_shard per repeated block,
then the model; Adam; fp32) and replays PyTorch's CUDA caching allocator. Attention runs
PyTorch's math kernel on both sides: the CPU's fused kernels are not the GPU's, and the
comparison is of the bookkeeping, not of kernel choice (which docs/sdpa.md covers). Compared: the
tracker's peak of tracked bytes against gpumem's peak of allocated bytes (without cuBLAS's
workspaces, which the tracker cannot see on a CPU, and shown with them), and gpumem's peak of
reserved bytes, which must lie above it.

    python python/tools/fsdp_memtracker.py [--models gpt2,llama-1b,llama-7b,vit] [--worlds 2,4,8]

Needs torch >= 2.6 (FSDP2), transformers and timm in the interpreter, and the gpumem binary
(GPUMEM, default target/release/gpumem) with GPUMEM_PYTHON set to the same interpreter.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 1 << 20
# name: (gpumem reference, batch, sequence length); the reference's kwargs are the config's.
MODELS = {
    "gpt2": ("hf:GPT2LMHeadModel()", 8, 1024),
    "llama-1b": (
        "hf:LlamaForCausalLM(hidden_size=2048,intermediate_size=5632,num_hidden_layers=22,num_attention_heads=32,num_key_value_heads=4,vocab_size=32000)",
        4,
        2048,
    ),
    "llama-7b": (
        "hf:LlamaForCausalLM(hidden_size=4096,intermediate_size=11008,num_hidden_layers=32,num_attention_heads=32,num_key_value_heads=32,vocab_size=32000)",
        2,
        2048,
    ),
    "vit": ("timm:vit_base_patch16_224", 64, None),
}


def build(ref):
    """The model a reference names, built in the caller's mode (fake here)."""
    import timm
    import transformers

    kind, spec = ref.split(":", 1)
    if kind == "timm":
        return timm.create_model(spec)
    cls, _, args = spec.partition("(")
    kwargs = dict((k, int(v)) for k, v in (a.split("=") for a in args.rstrip(")").split(",") if a))
    config_cls = getattr(
        transformers, cls.replace("LMHeadModel", "Config").replace("ForCausalLM", "Config")
    )
    return getattr(transformers, cls)(config_cls(**kwargs))


def tracker_peak(ref, batch, seq, world):
    """FSDPMemTracker's peak of one rank's tracked bytes (the step's second iteration)."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from gpumem_trace.loop import repeated_blocks

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    mesh = init_device_mesh("cpu", (world,))
    meta = None
    if ref.startswith("timm:"):
        # timm's constructor reads values (drop-path rates) that fake tensors do not have: built
        # on meta, its tensors then made fake.
        with torch.device("meta"):
            meta = build(ref)
    with FakeTensorMode(allow_non_fake_inputs=meta is not None):
        model = meta.to_empty(device="cpu") if meta is not None else build(ref)
        model.train()
        for b in repeated_blocks(model, ref, "FSDP"):
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
        if seq is None:
            x, y = torch.randn(batch, 3, 224, 224), torch.randint(0, 1000, (batch,))
            step = lambda: torch.nn.functional.cross_entropy(model(x), y)
        else:
            x = torch.randint(0, 1000, (batch, seq))
            step = lambda: model(input_ids=x, labels=x).loss
        tracker = FSDPMemTracker(model, opt)
        tracker.track_inputs((x,))
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with tracker, sdpa_kernel(SDPBackend.MATH):
            for i in range(2):
                step().backward()
                opt.step()
                opt.zero_grad()
                if i == 0:
                    tracker.reset_mod_stats()
        peak = tracker.get_tracker_snapshot("peak")
    return peak[torch.device("cpu")]["Total"]


def gpumem_peaks(ref, batch, seq, world, trace):
    """gpumem's (allocated, allocated without cuBLAS workspaces, reserved) peaks in bytes, of
    the tracer's trace (math attention) replayed for an H100."""
    cmd = [
        sys.executable,
        "-m",
        "gpumem_trace",
        ref,
        "--batch",
        str(batch),
        "--strategy",
        "fsdp",
        "--world-size",
        str(world),
        "--sdpa",
        "math",
        "--gpu-capability",
        "9.0",
        "--out",
        str(trace),
    ]
    if seq:
        cmd += ["--seq-len", str(seq)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    exe = os.environ.get("GPUMEM", "target/release/gpumem")
    v = json.loads(
        subprocess.run(
            [exe, "estimate", str(trace), "--gpu", "h100-80gb-sxm", "--json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    b = v["breakdown_bytes"]
    allocated = sum(b[k] for k in b if k not in ("context", "allocator_slack"))
    reserved = v.get("reserved_peak", {}).get("reserved_mib", None)
    reserved = int(reserved * MIB) if reserved is not None else allocated + b["allocator_slack"]
    return allocated, allocated - b.get("workspace", 0), reserved


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--worlds", default="2,4,8")
    p.add_argument("--scratch", default="/tmp", help="where the traces are written")
    a = p.parse_args()
    print(
        "| model | ranks | FSDPMemTracker peak MiB | gpumem allocated peak MiB (Δ) | without cuBLAS workspace (Δ) | gpumem reserved peak MiB |"
    )
    print("|---|---|---|---|---|---|")
    for name in a.models.split(","):
        ref, batch, seq = MODELS[name]
        for world in (int(w) for w in a.worlds.split(",")):
            t = tracker_peak(ref, batch, seq, world)
            alloc, bare, reserved = gpumem_peaks(
                ref, batch, seq, world, Path(a.scratch) / f"{name}-{world}.jsonl"
            )
            d = lambda x, t=t: f"{x / MIB:,.0f} ({(x - t) / t:+.1%})"
            print(
                f"| {name} b{batch}{f' s{seq}' if seq else ''} | {world} | {t / MIB:,.0f} | {d(alloc)} | {d(bare)} | {reserved / MIB:,.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
