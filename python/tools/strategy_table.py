"""One rank's memory under each multi-GPU strategy, as `gpumem estimate` gives it, beside
DeepSpeed's own model-state figure for ZeRO-2/3 — the table of docs/results.md.

    python python/tools/strategy_table.py [--models gpt2,llama-1b,llama-7b,vit] [--strategies ddp,fsdp,zero2,zero3] [--worlds 2,4,8] [--gpu h100-80gb-sxm]

Each strategy as it is usually run: DDP and FSDP2 with fp32 weights under bf16 autocast
(`amp-bf16`), ZeRO with DeepSpeed's bf16 mode (bf16 weights, fp32 master copy), Adam, activation
checkpointing on. Needs the gpumem binary (GPUMEM, default target/release/gpumem) and
GPUMEM_PYTHON naming an interpreter with torch, transformers and timm.
"""

import argparse
import json
import os
import subprocess

from fsdp_memtracker import MODELS  # the same configurations

STRATEGIES = {"ddp": "amp-bf16", "fsdp": "amp-bf16", "zero2": "bf16", "zero3": "bf16"}


def estimate(ref, batch, seq, strategy, world, gpu):
    exe = os.environ.get("GPUMEM", "target/release/gpumem")
    cmd = [
        exe,
        "estimate",
        ref,
        "--batch",
        str(batch),
        "--precision",
        STRATEGIES[strategy],
        "--checkpointing",
        "--strategy",
        strategy,
        "--world-size",
        str(world),
        "--gpu",
        gpu,
        "--json",
    ]
    if seq:
        cmd += ["--seq-len", str(seq)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        return None, p.stderr.strip().splitlines()[-1]
    return json.loads(p.stdout), None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--worlds", default="2,4,8")
    p.add_argument("--gpu", default="h100-80gb-sxm")
    a = p.parse_args()
    print(
        "| model | strategy | ranks | peak MiB (nvidia-smi) | upper bound MiB | fits | DeepSpeed's model states MiB |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in a.models.split(","):
        ref, batch, seq = MODELS[name]
        for strategy in a.strategies.split(","):
            for world in (int(w) for w in a.worlds.split(",")):
                v, err = estimate(ref, batch, seq, strategy, world, a.gpu)
                label = f"{name} b{batch}{f' s{seq}' if seq else ''}"
                if v is None:
                    print(f"| {label} | {strategy} | {world} | — | — | — | {err} |", flush=True)
                    continue
                ds = v.get("deepspeed")
                ds = f"{ds['gpu_mib']:,.0f}" if ds else ""
                fits = "yes" if v["upper_bound_fits"] else "no"
                print(
                    f"| {label} | {strategy} ({STRATEGIES[strategy]}) | {world} | {v['peak_mib']:,.0f} | {v['upper_bound_mib']:,.0f} | {fits} | {ds} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
