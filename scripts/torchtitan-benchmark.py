#!/usr/bin/env python3
"""gpumem against torchtitan's published H100 benchmark (pytorch/torchtitan
benchmarks/llama3_h100_202412_torchtitan.md, torchtitan 9dec370, December 2024: 96 GB H100s,
`max_reserved` per GPU, the maximum over the pipeline's ranks).

Each row is written as the TOML of that torchtitan (degrees under [training] and [experimental])
from the table's caption, the rest torchtitan's defaults, and sized with
`gpumem estimate --train-config FILE --world-size N --gpu h100-96gb --json`. The benchmark
measured torch's reserved memory, so the estimate compared is gpumem's peak less the CUDA
context. Rows that ran torch.compile and float8 linears state them in the TOML: float8 is traced
(torchao's Float8Linear, tensorwise, as `[float8] enable_float8_linear` reads), compile is not
(listed as not modelled) — each step is sized eager.

    GPUMEM_PYTHON=<python with torch 2.10 and torchtitan 0.2.2> \
        python3 scripts/torchtitan-benchmark.py [path/to/gpumem]   # prints a markdown table
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

# ran: eager, or torch.compile with float8 linears and async TP as the tables say; shard -1: the rest.
ROWS = """
table | job                              | flavor | world | batch | seq    | shard | tp | cp | pp | schedule        | AC   | ran                     | GiB
1     | FSDP 8                           | 8B     | 8     | 2     | 8192   | -1    | 1  | 1  | 1  | -               | op   | eager                   | 82.4
1     | FSDP 8                           | 8B     | 8     | 2     | 8192   | -1    | 1  | 1  | 1  | -               | op   | compile                 | 77.0
1     | FSDP 8                           | 8B     | 8     | 2     | 8192   | -1    | 1  | 1  | 1  | -               | op   | compile+float8          | 76.8
3     | FSDP 128                         | 8B     | 128   | 2     | 8192   | -1    | 1  | 1  | 1  | -               | op   | eager                   | 67.0
3     | FSDP 128                         | 8B     | 128   | 2     | 8192   | -1    | 1  | 1  | 1  | -               | op   | compile                 | 62.0
3     | FSDP 128                         | 8B     | 128   | 2     | 8192   | -1    | 1  | 1  | 1  | -               | op   | compile+float8          | 61.8
2     | FSDP 8                           | 8B     | 8     | 1     | 32768  | 8     | 1  | 1  | 1  | -               | full | compile+float8          | 83.9
2     | FSDP 4, CP 2                     | 8B     | 8     | 1     | 65536  | 4     | 1  | 2  | 1  | -               | full | compile+float8          | 84.2
2     | FSDP 2, CP 4                     | 8B     | 8     | 1     | 131072 | 2     | 1  | 4  | 1  | -               | full | compile+float8          | 84.0
2     | CP 8                             | 8B     | 8     | 1     | 262144 | 1     | 1  | 8  | 1  | -               | full | compile+float8          | 84.5
4     | FSDP 32, TP 8                    | 70B    | 256   | 16    | 8192   | -1    | 8  | 1  | 1  | -               | full | compile+float8          | 71.9
5     | FSDP 8, TP 8, PP 8 (1F1B)        | 405B   | 512   | 32    | 8192   | -1    | 8  | 1  | 8  | 1F1B            | full | compile+float8+async-tp | 82.5
5     | FSDP 8, TP 8, PP 8 (interleaved) | 405B   | 512   | 32    | 8192   | -1    | 8  | 1  | 8  | Interleaved1F1B | full | compile+float8+async-tp | 72.7
6     | FSDP 8, TP 8, PP 8 (1F1B)        | 405B   | 512   | 8     | 32768  | 8     | 8  | 1  | 8  | 1F1B            | full | compile+float8+async-tp | 75.3
6     | CP 8, TP 8, PP 8 (1F1B)          | 405B   | 512   | 8     | 262144 | 1     | 8  | 8  | 8  | 1F1B            | full | compile+float8+async-tp | 84.9
"""


def rows():
    lines = [[c.strip() for c in line.split("|")] for line in ROWS.strip().splitlines()]
    return [dict(zip(lines[0], line, strict=True)) for line in lines[1:]]


def toml(r):
    ac_lines = (
        "mode = 'selective'\nselective_ac_option = 'op'" if r["AC"] == "op" else "mode = 'full'"
    )
    text = f"""[model]
name = "llama3"
flavor = "{r["flavor"]}"
[optimizer]
name = "AdamW"
lr = 3e-4
[training]
batch_size = {r["batch"]}
seq_len = {r["seq"]}
data_parallel_replicate_degree = 1
data_parallel_shard_degree = {r["shard"]}
tensor_parallel_degree = {r["tp"]}
compile = {"false" if r["ran"] == "eager" else "true"}
[experimental]
context_parallel_degree = {r["cp"]}
pipeline_parallel_degree = {r["pp"]}
"""
    if "async-tp" in r["ran"]:
        text += "enable_async_tensor_parallel = true\n"
    if r["schedule"] != "-":
        text += f'pipeline_parallel_schedule = "{r["schedule"]}"\n'
    text += f"[activation_checkpoint]\n{ac_lines}\n"
    if "float8" in r["ran"]:
        text += "[float8]\nenable_float8_linear = true\n"
    return text


def main():
    gpumem = sys.argv[1] if len(sys.argv) > 1 else "target/release/gpumem"
    print("| table | job | ran | measured reserved | gpumem reserved | error | bound (reserved) |")
    print("|---|---|---|---|---|---|---|")
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, r in enumerate(rows()):
            path = os.path.join(tmp, f"row{i}.toml")
            with open(path, "w") as f:
                f.write(toml(r))
            job = ["--train-config", path, "--world-size", r["world"], "--gpu", "h100-96gb"]
            out = subprocess.run(
                [gpumem, "estimate", *job, "--json"], check=False, capture_output=True, text=True
            )
            truth = float(r["GiB"]) * 1024
            row = f"| {r['table']} | Llama 3.1 {r['flavor']}, {r['job']} | {r['ran']} | {truth:,.0f} MiB"
            if out.returncode != 0:
                print(f"{row} | refused: {out.stderr.strip()} | | |")
                continue
            d = json.loads(out.stdout)
            context = d["breakdown"]["context_mib"]
            est, bound = d["peak_mib"] - context, d["upper_bound_mib"] - context
            errors.append((est - truth) / truth)
            below = "" if bound >= truth else " (below)"
            print(f"{row} | {est:,.0f} MiB | {errors[-1]:+.1%} | {bound:,.0f} MiB{below} |")
    median = statistics.median(abs(e) for e in errors)
    print(f"\nmedian |error| {median:.1%} over {len(errors)} rows sized")


if __name__ == "__main__":
    main()
