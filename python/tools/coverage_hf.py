"""Coverage of the tracer over the installed transformers: every `*ForCausalLM`,
`*ForMaskedLM` and `*ForSequenceClassification` class whose config builds with small sizes is
traced (a training step, in a fresh process, as gpumem runs it). Usage:

    python python/tools/coverage_hf.py --precision amp-bf16 --out docs/coverage-hf-sweep.csv

A class counts when its config and model build on the meta device with the small sizes below
(the keys each config has); the CSV lists every class: `ok`, `failed` (with the tracer's
one-line cause) or `skipped` (its config or model does not build small, with the reason)."""

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PKG = Path(__file__).resolve().parents[1]
SUFFIXES = ("ForCausalLM", "ForMaskedLM", "ForSequenceClassification")
# Small sizes under every name configs use for them; only the keys a config has are given
# (head_dim = hidden / heads, except where latent attention ties it to its rope dimensions).
SMALL = {
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "dim": 64,
    "embed_dim": 64,
    "n_embed": 64,
    "d_embed": 64,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "n_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_decoder_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_heads": 4,
    "n_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "n_inner": 128,
    "ffn_dim": 128,
    "d_ff": 128,
    "d_inner": 128,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "hidden_dim": 128,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "head_dim": 16,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
    "n_positions": 512,
    "rotary_dim": 8,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    # Special tokens inside the small vocabulary (defaults index a full-size one).
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# The families people train in 2026, each small, for the precision × option matrix (--families).
LM = "hidden_size=128,intermediate_size=256,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,vocab_size=2048"
FAMILIES = [
    f"hf:LlamaForCausalLM({LM})",
    f"hf:MistralForCausalLM({LM})",
    f"hf:Qwen2ForCausalLM({LM})",
    f"hf:Qwen3ForCausalLM({LM},head_dim=32)",
    f"hf:Gemma2ForCausalLM({LM},head_dim=32)",
    f"hf:Gemma3ForCausalLM({LM},head_dim=32)",
    f"hf:Phi3ForCausalLM({LM},pad_token_id=0)",
    "hf:GPTNeoXForCausalLM(hidden_size=128,intermediate_size=256,num_hidden_layers=2,num_attention_heads=4,vocab_size=2048)",
    "hf:GPT2LMHeadModel(n_embd=128,n_layer=2,n_head=4,vocab_size=2048)",
    "hf:OPTForCausalLM(hidden_size=128,ffn_dim=256,num_hidden_layers=2,num_attention_heads=4,word_embed_proj_dim=128,vocab_size=2048)",
    "hf:BertForMaskedLM(hidden_size=128,num_hidden_layers=2,num_attention_heads=4,intermediate_size=256,vocab_size=2048)",
    "hf:BertForSequenceClassification(hidden_size=128,num_hidden_layers=2,num_attention_heads=4,intermediate_size=256,vocab_size=2048)",
    "hf:RobertaForMaskedLM(hidden_size=128,num_hidden_layers=2,num_attention_heads=4,intermediate_size=256,vocab_size=2048)",
    "hf:RobertaForSequenceClassification(hidden_size=128,num_hidden_layers=2,num_attention_heads=4,intermediate_size=256,vocab_size=2048)",
    "hf:T5ForConditionalGeneration(d_model=128,d_ff=256,d_kv=32,num_layers=2,num_heads=4,vocab_size=2048)",
    "hf:ViTForImageClassification(hidden_size=128,num_hidden_layers=2,num_attention_heads=4,intermediate_size=256)",
    "hf:CLIPModel()",
]
PRECISIONS = ["fp32", "amp-fp16", "amp-bf16", "fp16", "bf16"]


PROBE = r"""
import sys, json, torch, transformers
cls = getattr(transformers, sys.argv[1])
fields = set(cls.config_class().to_dict())
small = json.loads(sys.argv[2])
kw = {k: v for k, v in small.items() if k in fields}
if "num_key_value_heads" in kw and "num_attention_heads" not in kw:
    kw.pop("num_key_value_heads")
elif "num_key_value_heads" in kw and "kv_lora_rank" in fields:
    kw["num_key_value_heads"] = kw["num_attention_heads"]  # latent attention (MLA) repeats k/v by their ratio
if "qk_rope_head_dim" in fields:
    kw.pop("head_dim", None)
if int(sys.argv[3]):  # hybrid stacks: enough layers that full-attention ones exist among them
    for k in ("num_hidden_layers", "num_layers", "n_layer", "n_layers"):
        if k in kw:
            kw[k] = 8
def parameters(kw):
    with torch.device("meta"):
        return sum(p.numel() for p in cls(cls.config_class(**kw)).parameters())
try:
    n = parameters(kw)
except Exception as e:  # a model that refuses grouped-query attention
    if "num_key_value_heads" not in kw or "num_key_value_heads" not in str(e):
        raise
    kw["num_key_value_heads"] = kw["num_attention_heads"]
    n = parameters(kw)
if n > 200_000_000:
    raise SystemExit(f"not small: {n / 1e6:.0f}M parameters with the small keys (sub-configs keep their sizes)")
print(json.dumps([kw, getattr(cls, "main_input_name", "input_ids")]))
"""


def reference(name, kw):
    return f"hf:{name}({','.join(f'{k}={v}' for k, v in kw.items())})"


def probe(name, timeout, deep=False):
    """The small config keys for `name` and what it reads, or the reason it does not build small."""
    try:
        p = subprocess.run(
            [sys.executable, "-c", PROBE, name, json.dumps(SMALL), str(int(deep))],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return None, f"building it took over {timeout} s"
    if p.returncode != 0:
        return None, (p.stderr.strip().splitlines() or ["?"])[-1][:300]
    return json.loads(p.stdout.strip().splitlines()[-1]), ""


def trace(ref, args, precision=None, extra=(), tokens=True):
    out = f"/tmp/gpumem-coverage-hf-{os.getpid()}.jsonl"
    env = dict(os.environ, PYTHONPATH=str(PKG))
    length = (
        ["--seq-len", str(args.seq_len)] if tokens else []
    )  # audio models read their default length
    cmd = [
        sys.executable,
        "-m",
        "gpumem_trace",
        ref,
        "--batch",
        "2",
        *length,
        "--precision",
        precision or args.precision,
        "--gpu-capability",
        args.gpu_capability,
        "--out",
        out,
        "--timeout",
        str(args.timeout),
        *extra,
    ]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout + 60)
        ok, cause = (
            p.returncode == 0,
            ""
            if p.returncode == 0
            else (p.stderr.strip().splitlines() or ["?"])[-1].replace("gpumem_trace: ", ""),
        )
    except subprocess.TimeoutExpired:
        ok, cause = False, f"killed after {args.timeout + 60} s"
    # The tracer's message starts with the reference: keep what follows it.
    return ok, cause.split(" failed while tracing: ", 1)[-1][:400], time.time() - t0


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--precision", default="amp-bf16")
    a.add_argument("--seq-len", type=int, default=64)
    a.add_argument("--gpu-capability", default="9.0")
    a.add_argument("--timeout", type=int, default=300)
    a.add_argument("--only", help="comma-separated class names")
    a.add_argument(
        "--families",
        action="store_true",
        help="instead: the named families at every precision, plus a padded batch's mask and eager attention at amp-bf16",
    )
    a.add_argument("--out", default="coverage-hf-sweep.csv")
    args = a.parse_args()
    import transformers

    if args.families:
        return families(args)
    names = sorted(
        n
        for n in dir(transformers)
        if n.endswith(SUFFIXES) and not n.startswith(("TF", "Flax", "Auto"))
    )
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    rows = []
    for i, name in enumerate(names):
        found, why = probe(name, args.timeout)
        if found is None:
            rows.append((name, "skipped", "", "", why))
            print(f"[{i + 1}/{len(names)}] skipped {name}: {why}", flush=True)
            continue
        kw, main_input = found
        ref = reference(name, kw)
        ok, cause, secs = trace(ref, args, tokens=main_input == "input_ids")
        if not ok and "can only be called on Attention layers" in cause:
            # A hybrid stack whose two small layers are both linear-attention ones.
            found, _ = probe(name, args.timeout, deep=True)
            if found is not None:
                ref = reference(name, found[0])
                ok, cause, secs = trace(ref, args, tokens=main_input == "input_ids")
        rows.append((name, "ok" if ok else "failed", f"{secs:.1f}", ref, cause))
        print(
            f"[{i + 1}/{len(names)}] {'ok' if ok else 'FAILED'} {name} {secs:.1f}s {cause}",
            flush=True,
        )
    with open(args.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["class", "result", "seconds", "reference", "cause"])
        w.writerows(rows)
    built = [r for r in rows if r[1] != "skipped"]
    n_ok = sum(r[1] == "ok" for r in built)
    print(
        f"transformers {transformers.__version__}: {len(names)} classes, {len(built)} build small, "
        f"{n_ok} traced ({100 * n_ok / max(len(built), 1):.1f}%)"
    )


def families(args):
    rows = []
    for ref in FAMILIES:
        variants = [(p, ()) for p in PRECISIONS]
        if "Image" not in ref and "CLIP" not in ref:
            eager = ref.replace(")", ",attn_implementation=eager)") if "(" in ref else ref
            variants += [
                ("amp-bf16", ("--attention-mask", "padded")),
                ("amp-bf16", ("--attn", eager)),
            ]
        for precision, extra in variants:
            r, extra = (extra[1], ()) if extra[:1] == ("--attn",) else (ref, extra)
            ok, cause, secs = trace(r, args, precision, extra)
            label = " ".join([precision, *extra]) + (" eager" if r != ref else "")
            rows.append((ref, label, "ok" if ok else "failed", f"{secs:.1f}", cause))
            print(f"{'ok' if ok else 'FAILED'} {ref} [{label}] {secs:.1f}s {cause}", flush=True)
    with open(args.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "options", "result", "seconds", "cause"])
        w.writerows(rows)
    n_ok = sum(r[2] == "ok" for r in rows)
    print(f"{n_ok}/{len(rows)} traced")


if __name__ == "__main__":
    main()
