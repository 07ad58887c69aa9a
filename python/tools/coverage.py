"""Coverage of the tracer on a fixed random sample of timm models (and the Hugging Face classes
the issue names). Usage:

    python python/tools/coverage.py --timm 200 --seed 2026 --batch 8 --out coverage.csv

Each model is traced in a fresh process (as gpumem runs it), with a per-model timeout; the CSV
lists every model with ok/failed and the cause."""

import argparse
import csv
import os
import random
import subprocess
import sys
import time
from pathlib import Path

PKG = Path(__file__).resolve().parents[1]
HF = [
    "hf:GPT2LMHeadModel(n_embd=1280,n_layer=36,n_head=20)",
    "hf:BertForMaskedLM(hidden_size=768,num_hidden_layers=12,num_attention_heads=12,intermediate_size=3072,vocab_size=28996)",
    "hf:BertForMaskedLM(hidden_size=1024,num_hidden_layers=24,num_attention_heads=16,intermediate_size=4096,vocab_size=28996)",
    "hf:XLNetForSequenceClassification(xlnet-base-cased)",
    "hf:XLNetForSequenceClassification(xlnet-large-cased)",
    "hf:GPT2LMHeadModel(n_embd=1600,n_layer=48,n_head=25)",
]


def trace(ref, batch, timeout, extra=()):
    out = f"/tmp/gpumem-coverage-{os.getpid()}.jsonl"
    env = dict(os.environ, PYTHONPATH=str(PKG))
    t0 = time.time()
    try:
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpumem_trace",
                ref,
                "--batch",
                str(batch),
                "--out",
                out,
                "--timeout",
                str(timeout),
                *extra,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout + 60,
        )
        ok = p.returncode == 0
        cause = (
            "" if ok else (p.stderr.strip().splitlines() or ["?"])[-1].replace("gpumem_trace: ", "")
        )
    except subprocess.TimeoutExpired:
        ok, cause = False, f"killed after {timeout + 60} s"
    return ok, cause, time.time() - t0


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--timm", type=int, default=200)
    a.add_argument("--seed", type=int, default=2026)
    a.add_argument("--batch", type=int, default=8)
    a.add_argument("--timeout", type=int, default=300)
    a.add_argument("--hf", action="store_true")
    a.add_argument("--out", default="coverage.csv")
    args = a.parse_args()
    refs = []
    if args.timm:
        import timm

        names = sorted(timm.list_models())
        refs += [f"timm:{n}" for n in random.Random(args.seed).sample(names, args.timm)]
    if args.hf:
        refs += HF
    rows = []
    for i, ref in enumerate(refs):
        extra = ("--seq-len", "512") if ref.startswith("hf:") else ()
        ok, cause, secs = trace(
            ref, 2 if ref.startswith("hf:") else args.batch, args.timeout, extra
        )
        rows.append((ref, "ok" if ok else "failed", f"{secs:.1f}", cause))
        print(
            f"[{i + 1}/{len(refs)}] {'ok' if ok else 'FAILED'} {ref} {secs:.1f}s {cause}",
            flush=True,
        )
    with open(args.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "result", "seconds", "cause"])
        w.writerows(rows)
    n_ok = sum(r[1] == "ok" for r in rows)
    print(f"{n_ok}/{len(rows)} traced ({100 * n_ok / max(len(rows), 1):.1f}%)")


if __name__ == "__main__":
    main()
