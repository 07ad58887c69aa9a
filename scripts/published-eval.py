#!/usr/bin/env python3
"""gpumem on the published dev rows: one command, stdlib only.

    python3 scripts/published-eval.py [--gpumem PATH] [--jobs N] [--only LINE,LINE]

Reads the dev CSV ($PUBLISHED_CSV, default /work/shared/data/published/published_runs_dev.csv)
and data/published/jobs.toml (written by scripts/published-jobs.py, whose docstring states the
mapping rules), runs `gpumem estimate ... --json` for every expressible row (at most --jobs at
once, default 2), compares the quantity each row measured, and writes
data/published/eval-results.csv and docs/published-eval.md. Hub ids are read offline from a
Hugging Face cache laid out (in a temporary directory) from data/hub-configs/ (and the
directories in $HUB_CONFIG_DIRS, colon-separated, for configs not yet committed there). The tracer's
Python is $GPUMEM_PYTHON (as gpumem itself reads it). Diagnoses of individual rows, written
after looking at them, come from data/published/diagnoses.toml (never used to change an estimate).
"""
import argparse
import concurrent.futures as cf
import csv
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
CSV = os.environ.get("PUBLISHED_CSV", "/work/shared/data/published/published_runs_dev.csv")
GIB = 1024 ** 3
MIB = 1024 ** 2


def hub_cache(tmp):
    """data/hub-configs laid out as huggingface_hub lays out its cache."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    dirs = [os.path.join(ROOT, "data", "hub-configs")] + [d for d in os.environ.get("HUB_CONFIG_DIRS", "").split(":") if d]
    for src in dirs:
      for org in sorted(os.listdir(src)):
        if not os.path.isdir(os.path.join(src, org)):
            continue
        for name in sorted(os.listdir(os.path.join(src, org))):
            if not os.path.exists(os.path.join(src, org, name, "config.json")):
                continue
            repo = os.path.join(tmp, f"models--{org}--{name}")
            if os.path.exists(repo):
                continue
            snap = os.path.join(repo, "snapshots", commit)
            os.makedirs(snap, exist_ok=True)
            os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
            with open(os.path.join(repo, "refs", "main"), "w") as f:
                f.write(commit)
            shutil.copy(os.path.join(src, org, name, "config.json"), os.path.join(snap, "config.json"))
    return tmp


def model_arg(model, tmp):
    """`hf:CLASS@ORG/NAME`: the published config with another head class (a sequence classifier of a
    checkpoint published as a masked LM), written as a config.json beside the cache."""
    if model.startswith("hf:") and "@" in model:
        cls, hubid = model[3:].split("@", 1)
        cfg = json.load(open(os.path.join(ROOT, "data", "hub-configs", hubid, "config.json")))
        cfg["architectures"] = [cls]
        path = os.path.join(tmp, "override", hubid.replace("/", "--") + "--" + cls + ".json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        json.dump(cfg, open(path, "w"))
        return path
    return model


@functools.cache
def builtin_profiles(gpumem):
    """The binary's built-in GPU profiles (`gpumem gpus --json`), read once."""
    out = subprocess.run([gpumem, "gpus", "--json"], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def profile_arg(job, gpumem, tmp):
    """`--gpu NAME`, or where the row states the CUDA context it measured (rule R19) a
    `--profile` file: the built-in profile with that context."""
    if "context_mib" not in job:
        return ["--gpu", job["gpu"]]
    gpu = dict(next(g for g in builtin_profiles(gpumem) if g["name"] == job["gpu"]))
    gpu["cuda_context_mib"] = float(job["context_mib"])
    value = lambda v: ("{ " + ", ".join(f"{k} = {json.dumps(x)}" for k, x in v.items()) + " }"
                       if isinstance(v, dict) else json.dumps(v))
    path = os.path.join(tmp, "profiles", "%d.toml" % job["line"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("[[gpu]]\n" + "".join(f"{k} = {value(v)}\n" for k, v in gpu.items()))
    return ["--profile", path]


def command(job, gpumem, tmp):
    a = [gpumem, "estimate", model_arg(job["model"], tmp), "--json", *profile_arg(job, gpumem, tmp),
         "--batch", str(job["batch"]), "--precision", job["precision"], "--optimizer", job["optimizer"]]
    if "seq_len" in job:
        a += ["--seq-len", str(job["seq_len"])]
    if "seq_len_histogram" in job:  # rule R17: written beside the cache, a CSV of `length,count`
        path = os.path.join(tmp, "lengths", "%d.csv" % job["line"])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.writelines("%d,%d\n" % (n, w) for n, w in job["seq_len_histogram"])
        a += ["--seq-len-histogram", path]
    if job.get("checkpointing") == "full":
        a.append("--checkpointing")
    elif job.get("checkpointing") == "selective":
        a.append("--selective-checkpointing")
    elif job.get("checkpointing") == "selective-op":
        a.append("--checkpointing=selective-op")
    if "lora" in job:
        a += ["--lora", job["lora"]]
    if "strategy" in job and not any(x == "--deepspeed" for x in job.get("extra", [])):
        a += ["--strategy", job["strategy"], "--world-size", str(job["world_size"])]
    elif "strategy" in job:
        a += ["--world-size", str(job["world_size"])]
    if "grad_accum" in job:
        a += ["--grad-accum", str(job["grad_accum"])]
    if job.get("keep_grads"):
        a.append("--keep-grads")
    a += [os.path.join(ROOT, x) if x.endswith(".json") else x for x in job.get("extra", [])]
    return a


def estimate(job, gpumem, tmp, timeout):
    cmd = command(job, gpumem, tmp)
    t = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return cmd, None, f"timeout after {timeout} s", time.time() - t
    if p.returncode != 0:
        return cmd, None, (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1][:300], time.time() - t
    return cmd, json.loads(p.stdout), None, time.time() - t


def compare(job, est, measured_gib):
    """(estimate GiB, bound GiB, relative error or None, verdict) for the row's measured quantity."""
    ctx = est["breakdown"]["context_mib"] * MIB
    alloc = est["allocator"]["peak_allocated"]
    reserved = est["allocator"]["peak_reserved"]
    peak = est["peak_bytes"]
    bound = est["upper_bound_bytes"]
    m = job["measure"]
    if m == "allocated":
        e, b = alloc, bound - ctx
    elif m == "reserved":
        e, b = reserved, bound - ctx
    elif m == "nvidia-smi":
        e, b = peak, bound
    elif m == "oom":
        return peak / GIB, bound / GIB, None, "ok" if not est["fits"] else "WRONG (estimate fits)"
    elif m == "fits":
        return peak / GIB, bound / GIB, None, "ok" if est["fits"] else "WRONG (estimate does not fit)"
    elif m == "boundary":
        cap = job["capacity_gib"] * GIB
        return peak / GIB, bound / GIB, (peak - cap) / cap, "ok" if peak <= cap else "WRONG (estimate exceeds capacity)"
    else:
        raise ValueError(m)
    err = (e - measured_gib * GIB) / (measured_gib * GIB)
    return e / GIB, b / GIB, err, "bound ok" if b >= measured_gib * GIB else "BOUND BELOW"


def source_of(r):
    return r["source"].split()[0].replace("github:", "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpumem", default=os.environ.get("GPUMEM_BIN", "/work/main/target/release/gpumem"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", default="")
    ap.add_argument("--built-from", default="", help="what the binary was built from, for the report")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--out-csv", default=os.path.join(ROOT, "data", "published", "eval-results.csv"))
    ap.add_argument("--out-md", default=os.path.join(ROOT, "docs", "published-eval.md"))
    args = ap.parse_args()
    rows = list(csv.DictReader(open(CSV, newline="")))
    jobs = {j["line"]: j for j in tomllib.load(open(os.path.join(ROOT, "data", "published", "jobs.toml"), "rb"))["row"]}
    diag_path = os.path.join(ROOT, "data", "published", "diagnoses.toml")
    diag = tomllib.load(open(diag_path, "rb")) if os.path.exists(diag_path) else {}
    rowdiag = {d["line"]: d for d in diag.get("row", [])}
    only = {int(x) for x in args.only.split(",") if x}
    tmp = tempfile.mkdtemp(prefix="gpumem-pubeval-")
    os.environ["HF_HUB_CACHE"] = hub_cache(os.path.join(tmp, "hub"))
    version = args.built_from or subprocess.run(
        ["git", "-C", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(args.gpumem)))), "log", "-1",
         "--format=%h %cs"], capture_output=True, text=True).stdout.strip() or "unknown"
    todo = [(i + 2, r) for i, r in enumerate(rows) if jobs[i + 2]["status"] == "run" and (not only or i + 2 in only)]
    results = {}
    with cf.ThreadPoolExecutor(args.jobs) as ex:
        futs = {ex.submit(estimate, jobs[n], args.gpumem, tmp, args.timeout): n for n, _ in todo}
        for k, f in enumerate(cf.as_completed(futs)):
            n = futs[f]
            results[n] = f.result()
            cmd, est, err, dt = results[n]
            print(f"[{k + 1}/{len(todo)}] line {n}: {'ok' if est else err} ({dt:.0f} s)", file=sys.stderr, flush=True)
            if (k + 1) % 5 == 0 and k + 1 < len(todo):
                report(rows, jobs, rowdiag, results, tmp, args, version, diag, pending=len(todo) - k - 1)
    report(rows, jobs, rowdiag, results, tmp, args, version, diag, pending=0)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {args.out_csv} and {args.out_md}", file=sys.stderr)


def report(rows, jobs, rowdiag, results, tmp, args, version, diag, pending):
    out = []
    for i, r in enumerate(rows):
        n = i + 2
        j = jobs[n]
        d = rowdiag.get(n, {})
        rec = {"line": n, "key": j["key"], "source": source_of(r), "model": r["model"], "gpu": r["gpu"],
               "what_measured": r["what_measured"], "measured_gib": r["measured_gib"], "status": j["status"],
               "reason": j.get("reason", ""), "tags": " ".join(j.get("tags", [])), "measure": j.get("measure", ""),
               "estimate_gib": "", "bound_gib": "", "error": "", "verdict": "", "gpumem_error": "", "command": "",
               "mechanism": d.get("mechanism", ""), "diagnosis": d.get("diagnosis", "")}
        if j["status"] == "run" and n not in results:
            rec["status"] = "pending"
        if n in results:
            cmd, est, err, _ = results[n]
            rec["command"] = " ".join(["gpumem"] + [c if " " not in c else repr(c) for c in cmd[1:]]).replace(tmp, "$TMP")
            if est is None:
                rec["status"] = "refused"
                rec["gpumem_error"] = err.replace(tmp, "$TMP")
            else:
                mg = float(r["measured_gib"]) if r["measured_gib"] else None
                e, b, er, v = compare(j, est, mg)
                rec.update(estimate_gib=f"{e:.2f}", bound_gib=f"{b:.2f}", verdict=v,
                           error="" if er is None else f"{er:+.4f}")
        out.append(rec)
    with open(args.out_csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(out[0].keys()))
        w.writeheader()
        w.writerows(out)
    write_md(out, args, version, diag, pending)


def pct(x):
    return f"{100 * x:+.1f}%"


def summary(recs):
    errs = [abs(float(r["error"])) for r in recs if r["error"] and r["measure"] not in ("boundary",)]
    cov = [r for r in recs if r["verdict"] in ("bound ok", "BOUND BELOW")]
    med = statistics.median(errs) if errs else float("nan")
    return len(errs), med, (sum(r["verdict"] == "bound ok" for r in cov), len(cov))


def write_md(out, args, version, diag, pending=0):
    total = len(out)
    ran = [r for r in out if r["status"] == "run"]
    quant = [r for r in ran if r["error"] and r["measure"] != "boundary"]
    exact = [r for r in quant if not r["tags"]]
    L = []
    L.append("# gpumem on the published dev rows\n")
    L.append(f"Generated by `python3 scripts/published-eval.py` (gpumem `{args.gpumem}`, built from {version}; "
             f"`GPUMEM_PYTHON` torch tracer). Rows: {CSV}. Jobs: `data/published/jobs.toml` (rules R1–R14 in "
             "`scripts/published-jobs.py`). Per-row results: `data/published/eval-results.csv`.\n")
    L.append("Error = (estimate − measured) / measured, on the quantity the row measured: torch max allocated ↔ "
             "gpumem's allocated peak, max reserved ↔ reserved peak, nvidia-smi ↔ `peak_mib`. Bound: "
             "`upper_bound` (nvidia-smi rows), `upper_bound − context` (torch-side rows).\n")
    if pending:
        L.append(f"**PARTIAL: {pending} expressible rows still being estimated when this was written; "
                 "they count as neither compared nor refused below.**\n")
    L.append("## Headline\n")
    n, med, (ok, nc) = summary(quant)
    ne, mede, (oke, nce) = summary(exact)
    L.append("| | rows |\n|---|---|")
    L.append(f"| dev rows | {total} |")
    L.append(f"| expressible (a gpumem job) | {len([r for r in out if r['status'] in ('run', 'refused', 'pending')])} |")
    L.append(f"| … of which gpumem refused or failed | {len([r for r in out if r['status'] == 'refused'])} |")
    L.append(f"| … estimated, with a peak figure to compare | {n} |")
    L.append(f"| … estimated, fits/OOM/boundary checks | {len([r for r in ran if r['measure'] in ('oom', 'fits', 'boundary')])} |")
    L.append(f"| not expressible today | {len([r for r in out if r['status'] == 'no'])} |\n")
    L.append(f"**Median |error| {100 * med:.1f}% over {n} rows; bound ≥ measured on {ok}/{nc} "
             f"({100 * ok / max(nc, 1):.0f}%).** Rows with no approximation tag ({ne}): median {100 * mede:.1f}%, "
             f"bound covers {oke}/{nce}.\n")
    signed = [float(r["error"]) for r in quant]
    if signed:
        L.append(f"Signed error: median {pct(statistics.median(signed))}; under-estimates {sum(e < 0 for e in signed)}, "
                 f"over-estimates {sum(e > 0 for e in signed)}.\n")
    chk = [r for r in ran if r["measure"] in ("oom", "fits", "boundary")]
    if chk:
        L.append(f"Fits/OOM checks: {sum(r['verdict'] == 'ok' for r in chk)}/{len(chk)} right.\n")
    L.append("## Per source\n")
    L.append("| source | rows | expressible | refused | compared | median abs error | bound covers | fits/OOM checks right |")
    L.append("|---|---|---|---|---|---|---|---|")
    for s in sorted({r["source"] for r in out}):
        rs = [r for r in out if r["source"] == s]
        q = [r for r in rs if r["error"] and r["measure"] != "boundary"]
        n, med, (ok, nc) = summary(q)
        ch = [r for r in rs if r["measure"] in ("oom", "fits", "boundary") and r["status"] == "run"]
        L.append(f"| {s} | {len(rs)} | {len([r for r in rs if r['status'] in ('run', 'refused', 'pending')])} | "
                 f"{len([r for r in rs if r['status'] == 'refused'])} | {n} | "
                 f"{'' if not n else f'{100 * med:.1f}%'} | {'' if not nc else f'{ok}/{nc}'} | "
                 f"{'' if not ch else str(sum(r['verdict'] == 'ok' for r in ch)) + '/' + str(len(ch))} |")
    L.append("\n## Per approximation tag (rows compared)\n")
    L.append("| tag | rows | median abs error | median signed error | bound covers |")
    L.append("|---|---|---|---|---|")
    tags = sorted({t for r in quant for t in r["tags"].split()})
    for t in ["(none)"] + tags:
        q = [r for r in quant if (t in r["tags"].split()) or (t == "(none)" and not r["tags"])]
        if not q:
            continue
        n, med, (ok, nc) = summary(q)
        L.append(f"| {t} | {n} | {100 * med:.1f}% | {pct(statistics.median(float(r['error']) for r in q))} | {ok}/{nc} |")
    L.append("\n## Rows not expressible today, by missing mechanism\n")
    L.append("| mechanism | rows | lines |\n|---|---|---|")
    reasons = {}
    for r in out:
        if r["status"] == "no":
            reasons.setdefault(r["reason"], []).append(r["line"])
    for k, v in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
        L.append(f"| {k} | {len(v)} | {', '.join(map(str, v))} |")
    ref = [r for r in out if r["status"] == "refused"]
    if ref:
        L.append("\n## Rows gpumem refused or failed\n")
        L.append("| line | source | model | gpumem's message |\n|---|---|---|---|")
        for r in ref:
            L.append(f"| {r['line']} | {r['source']} | {r['model']} | {r['gpumem_error'].replace('|', '/')} |")
    if diag.get("mechanism"):
        L.append("\n## Gap by mechanism (diagnosed)\n")
        L.append("| mechanism | rows | median signed error | what it is |\n|---|---|---|---|")
        for m in diag["mechanism"]:
            q = [r for r in quant if r["mechanism"] == m["name"]]
            ms = pct(statistics.median(float(r["error"]) for r in q)) if q else ""
            L.append(f"| {m['name']} | {len(q)} | {ms} | {m['what']} |")
    L.append("\n## Worst 15 rows\n")
    L.append("| line | source | model | measured | est | bound | error | diagnosis |\n|---|---|---|---|---|---|---|---|")
    for r in sorted(quant, key=lambda r: -abs(float(r["error"])))[:15]:
        L.append(f"| {r['line']} | {r['source']} | {r['model']} ({r['measure']}) | {r['measured_gib']} | "
                 f"{r['estimate_gib']} | {r['bound_gib']} | {pct(float(r['error']))} | {r['diagnosis'] or r['tags']} |")
    L.append("\n## All compared rows\n")
    L.append("| line | source | model | measure | measured GiB | estimate GiB | bound GiB | error | tags |")
    L.append("|---|---|---|---|---|---|---|---|---|")
    for r in ran:
        L.append(f"| {r['line']} | {r['source']} | {r['model']} | {r['measure']} | {r['measured_gib']} | "
                 f"{r['estimate_gib']} | {r['bound_gib']} | {r['error'] and pct(float(r['error'])) or r['verdict']} | {r['tags']} |")
    if diag.get("notes"):
        L.append("\n## Notes\n")
        L.append(diag["notes"])
    with open(args.out_md, "w") as f:
        f.write("\n".join(L) + "\n")


if __name__ == "__main__":
    main()
