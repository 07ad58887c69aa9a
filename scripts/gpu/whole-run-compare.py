"""Sets the whole runs measured on an H200 (scripts/gpu/whole-run-h200.sh; rows in
data/h200/whole-run/) beside `gpumem estimate --whole-run` of the same jobs, part by part, and
prints a Markdown table.

    GPUMEM_PYTHON=… python3 scripts/gpu/whole-run-compare.py [GPUMEM] > data/h200/whole-run/comparison.md

(GPUMEM_PYTHON: a Python with the measured PEFT, 0.21.0, whose prepare_model_for_kbit_training
the trace follows.)

The estimate uses the H200's calibrated profile (data/h200/h200-probed.toml: the one calibration
run). Measured "as nvidia-smi shows it" is PyTorch's most reserved in the part plus what the
device held outside the allocator at the part's end, where NVML's used (what the rows recorded)
counts the driver's reserved memory, which nvidia-smi does not (context-terms.jsonl: 615 MiB).
The measured load is from_pretrained and PEFT's prepare_model_for_kbit_training together.
"""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "data/h200/whole-run"
MIB = 1 << 20
ALL_LINEAR = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
LLAMA8B = "hf:LlamaForCausalLM(hidden_size=4096,intermediate_size=14336,num_hidden_layers=32,num_attention_heads=32,num_key_value_heads=8,vocab_size=128256,max_position_embeddings=8192,rope_theta=500000.0)"
MISTRAL7B = "hf:MistralForCausalLM(hidden_size=4096,intermediate_size=14336,num_hidden_layers=32,num_attention_heads=32,num_key_value_heads=8,vocab_size=32000,max_position_embeddings=32768)"
LLAMA1B = "hf:LlamaForCausalLM(hidden_size=2048,intermediate_size=8192,num_hidden_layers=16,num_attention_heads=32,num_key_value_heads=8,vocab_size=128256,max_position_embeddings=8192,rope_theta=500000.0,tie_word_embeddings=true)"
QWEN05B = "hf:Qwen2ForCausalLM(hidden_size=896,intermediate_size=4864,num_hidden_layers=24,num_attention_heads=14,num_key_value_heads=2,vocab_size=151936,max_position_embeddings=32768,tie_word_embeddings=true)"
# The jobs of whole-run-h200.sh in gpumem's words. PEFT's prepare_model_for_kbit_training turns
# on transformers' gradient checkpointing with torch's default (reentrant) and casts the rest to
# fp32 under the Trainer's bf16 autocast: amp-bf16 (QLORA). The Qwen job loads in bf16: pure
# bf16.
QLORA = "--precision amp-bf16 --checkpointing=full-reentrant --eval-logits --lora=quant=nf4,"
JOBS = {
    job: flags.split()
    for job, flags in {
        "qlora-llama8b": f"{LLAMA8B} --batch 4 --seq-len 1024 --eval-batches 8"
        f" --eval-batch-size 4 {QLORA}r=16,alpha=32,dropout=0.05,targets={ALL_LINEAR}",
        "qlora-mistral7b": f"{MISTRAL7B} --batch 2 --seq-len 2048 --grad-accum 2"
        " --optimizer adamw8bit --eval-batches 4 --eval-batch-size 2"
        f" {QLORA}r=64,alpha=16,dropout=0.1,targets={ALL_LINEAR}",
        "qlora-llama1b": f"{LLAMA1B} --batch 4 --seq-len 1024 --eval-batches 8"
        " --eval-batch-size 4 --eval-accumulation-steps 2"
        f" {QLORA}r=16,alpha=32,dropout=0.05,targets={ALL_LINEAR}",
        "lora-qwen05b": f"{QWEN05B} --batch 4 --seq-len 1024 --precision bf16"
        " --lora=r=16,alpha=32,targets=q_proj,v_proj --eval-batches 20 --eval-batch-size 4"
        " --eval-logits",
    }.items()
}


def driver_reserved():
    row = json.loads((DATA / "context-terms.jsonl").read_text().splitlines()[0])
    return row["nvml_used"] - row["total_minus_free"]


def measured(job, nvml_extra):
    # The Trainer prints its own dicts (single quotes) among the rows.
    lines = (DATA / f"{job}.jsonl").read_text().splitlines()
    rows = {r["part"]: r for r in (json.loads(x) for x in lines if x.startswith('{"'))}
    parts = {}
    for name, row in rows.items():
        outside = row["device_used_end"] - nvml_extra - row["reserved_end"]
        part = {
            "reserved": row["max_reserved"],
            "allocated": row["max_allocated"],
            "smi": row["max_reserved"] + outside,
        }
        key = "load" if name == "prepare" else name
        if key in parts:
            part = {k: max(parts[key][k], v) for k, v in part.items()}
        parts[key] = part
    return parts


def estimate(gpumem, job, extra=()):
    cmd = [
        gpumem,
        "estimate",
        *JOBS[job],
        *extra,
        "--save",
        "sharded",
        "--profile",
        str(ROOT / "data/h200/h200-probed.toml"),
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    e = json.loads(out)
    parts = {
        p["name"]: {
            "reserved": p["reserved_bytes"],
            "allocated": p["allocated_bytes"],
            "smi": p["peak_bytes"],
        }
        for p in e["phases"]
    }
    return e, parts


def pct(est, truth):
    return f"{100 * (est - truth) / truth:+.1f}%"


def main():
    gpumem = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "target/release/gpumem")
    extra = driver_reserved()
    print(
        "| job | part | measured MiB (nvidia-smi / reserved / allocated) | estimated MiB | error (nvidia-smi / reserved / allocated) |"
    )
    print("|---|---|---|---|---|")
    runs = []
    for job in JOBS:
        truth = measured(job, extra)
        e, est = estimate(gpumem, job)
        # Evaluations with eval_accumulation_steps ran after the first one, whose cache they
        # started with (only their allocated peak is theirs), and empty the cache: the save
        # after them is set beside the estimate of a run whose evaluation is the last of them.
        accumulated = [
            p.removeprefix("evaluate-acc") for p in truth if p.startswith("evaluate-acc")
        ]
        later = []
        for steps in accumulated:
            _, acc = estimate(gpumem, job, ["--eval-accumulation-steps", steps])
            t, g = truth[f"evaluate-acc{steps}"]["allocated"], acc["evaluate"]["allocated"]
            later.append(
                f"| {job} | evaluate, eval_accumulation_steps {steps} | allocated {t / MIB:,.0f} | allocated {g / MIB:,.0f} | {pct(g, t)} |"
            )
            est["save"] = acc["save"]
        for part in ("load", "train", "evaluate", "save"):
            t, g = truth.get(part), est[part]
            if t is None:  # the measuring run ended before it (whole-run-h200.sh's timeouts)
                print(
                    f"| {job} | {part} | not measured | {g['smi'] / MIB:,.0f} / {g['reserved'] / MIB:,.0f} / {g['allocated'] / MIB:,.0f} | |"
                )
                continue
            capped = (
                " (the GPU's capacity: reserved ran into it)"
                if t["reserved"] > 0.98 * e["capacity_mib"] * MIB
                else ""
            )
            print(
                f"| {job} | {part} | {t['smi'] / MIB:,.0f} / {t['reserved'] / MIB:,.0f} / {t['allocated'] / MIB:,.0f}{capped} "
                f"| {g['smi'] / MIB:,.0f} / {g['reserved'] / MIB:,.0f} / {g['allocated'] / MIB:,.0f} "
                f"| {pct(g['smi'], t['smi'])} / {pct(g['reserved'], t['reserved'])} / {pct(g['allocated'], t['allocated'])} |"
            )
        for line in later:
            print(line)
        peak = max(p["smi"] for p in truth.values())
        runs.append((job, peak, e["peak_bytes"], e["upper_bound_bytes"]))
    print()
    print(
        "| job | the run's peak, measured (nvidia-smi) | estimated | upper bound | bound ≥ measured |"
    )
    print("|---|---|---|---|---|")
    for job, peak, est, bound in runs:
        print(
            f"| {job} | {peak / MIB:,.0f} | {est / MIB:,.0f} ({pct(est, peak)}) | {bound / MIB:,.0f} | {'yes' if bound >= peak else 'NO'} |"
        )


if __name__ == "__main__":
    main()
