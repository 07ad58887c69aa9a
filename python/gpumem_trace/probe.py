"""Measures, on a CUDA GPU, the facts of the software stack a CPU-side trace cannot know, and
prints them as one JSON document (``gpumem probe`` writes them into a GPU profile):

- ``stack``: GPU, driver, CUDA, torch and cuDNN versions;
- ``context``: device memory in use outside PyTorch's allocator (what nvidia-smi adds to
  reserved) after the CUDA context starts, after cuBLAS, after cuDNN, and at the end;
- ``cublas``: the workspace bytes the first cuBLAS / cuBLASLt call on a thread allocates;
- ``conv``: for each convolution configuration, the workspace allocations cuDNN's chosen engine
  makes in forward, backward-data and backward-filter, with ``cudnn.benchmark`` off and on;
- ``sdpa``: which attention kernel runs, per dtype / head dim / mask / GQA case.

Every size is read from the caching allocator's own record of allocation requests
(``torch.cuda.memory._record_memory_history``): a workspace is an allocation made and given back
inside the kernel call, not a difference of peaks.

    python -m gpumem_trace.probe --out probe.json [--configs convs.json] [--models JOBS.csv]

``--models`` traces the listed jobs (CSV with model, batch_size, precision, input columns, or
``MODEL:BATCH[:PRECISION]`` arguments) on the CPU and probes exactly their convolutions;
``--configs`` reads configurations already listed (``python -m gpumem_trace.probe --list``
writes them); with neither, the documented grid (``GRID``: common CNNs) is probed.
Exit codes: 0 written; 2 bad arguments; 3 no CUDA device.
"""

import argparse
import csv
import json
import os
import sys
import tempfile
import time

# The default grid: the convolutions of common CNNs at two batch sizes, fp32 and bf16.
GRID_MODELS = [
    "torchvision:resnet18",
    "torchvision:resnet50",
    "torchvision:vgg16",
    "torchvision:mobilenet_v2",
    "torchvision:efficientnet_b0",
    "torchvision:densenet121",
    "torchvision:convnext_tiny",
    "torchvision:regnet_y_400mf",
]
GRID_BATCHES = [16, 64]
GRID_PRECISIONS = ["fp32", "amp-bf16"]


# --- which convolutions a job runs (CPU) -----------------------------------------------------


def job_configs(model, batch, precision="fp32", input_shape=None, channels_last=False):
    """The (config, n, passes) of every convolution the job's training step runs, read from the
    tracer's own workspace events: one place decides what a configuration is."""
    from .loop import TraceOptions, trace_training

    opts = TraceOptions(
        model=model,
        batch=batch,
        precision=precision,
        iterations=2,
        input_shape=input_shape,
        channels_last=channels_last,
    )
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.jsonl")
        trace_training(opts, path)
        found = {}
        with open(path) as f:
            next(f)
            for line in f:
                if '"workspace"' not in line:
                    continue
                e = json.loads(line)
                if e.get("ev") == "workspace":
                    found.setdefault((e["conv"], e["n"]), set()).add(e["pass"])
    return [{"config": c, "n": n, "passes": sorted(p)} for (c, n), p in found.items()]


def parse_job(item):
    """``MODEL:BATCH[:PRECISION[:CxHxW]]`` (MODEL may itself hold a colon: torchvision:resnet50)."""
    parts = item.split(":")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i].isdigit():
            model, batch, rest = ":".join(parts[:i]), int(parts[i]), parts[i + 1 :]
            shape = tuple(int(x) for x in rest[1].split("x")) if len(rest) > 1 else None
            return model, batch, (rest[0] if rest else "fp32"), shape
    raise ValueError(f"`{item}` is not MODEL:BATCH[:PRECISION[:CxHxW]]")


def read_jobs(path):
    """Jobs of a measurement CSV (gpumem's schema: model, batch_size, precision, input)."""
    jobs = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            shape = tuple(int(x) for x in row["input"].split("x")) if row.get("input") else None
            jobs.append(
                (row["model"], int(row["batch_size"]), row.get("precision") or "fp32", shape)
            )
    return jobs


def configs_of(jobs):
    seen = {}
    for model, batch, precision, shape in jobs:
        try:
            for c in job_configs(model, batch, precision, shape):
                seen.setdefault((c["config"], c["n"]), set()).update(c["passes"])
        except Exception as e:  # a job the tracer cannot run: its convolutions stay unprobed
            print(
                f"gpumem_trace.probe: skipping {model} b{batch}: {type(e).__name__}: {e}",
                file=sys.stderr,
            )
    return [{"config": c, "n": n, "passes": sorted(p)} for (c, n), p in sorted(seen.items())]


def grid_jobs():
    return [(m, b, p, None) for m in GRID_MODELS for b in GRID_BATCHES for p in GRID_PRECISIONS]


# --- the allocator's record ------------------------------------------------------------------


class Allocations:
    """The caching allocator's history of this process. Allocations are numbered by the
    allocator's own counter (``allocation.all.allocated``), so a span of the program is the
    counts read before and after it, whatever the history held before recording began."""

    def __init__(self, torch):
        self.torch = torch
        torch.cuda.memory._record_memory_history(context=None, max_entries=2_000_000)
        self.keep = []

    def count(self):
        return self.torch.cuda.memory.memory_stats_as_nested_dict()["allocation"]["all"][
            "allocated"
        ]

    def mark(self):
        """The number of a fresh allocation made now, after the device is idle: frees that come
        after this point in the program come after it in the record."""
        self.torch.cuda.synchronize()
        self.keep.append(self.torch.empty(1, device="cuda"))
        return self.count() - 1

    def stop(self):
        """[size, number of the first allocation made after it was freed (None: live)] for
        each allocation, indexed by count - ``self.offset``."""
        end = self.count()
        snap = self.torch.cuda.memory._snapshot()
        self.torch.cuda.memory._record_memory_history(enabled=None)
        self.keep.clear()
        allocs, live = [], {}
        for e in (snap.get("device_traces") or [[]])[0]:
            if e["action"] == "alloc":
                live[e["addr"]] = len(allocs)
                allocs.append([e["size"], None])
            elif e["action"] in ("free_requested", "free") and e["addr"] in live:
                allocs[live.pop(e["addr"])][1] = len(allocs)
        self.offset = end - len(allocs)
        return allocs

    def span(self, allocs, start, end):
        """(size, freed inside) of each allocation numbered in [start, end), in order."""
        out = []
        for k in range(start - self.offset, end - self.offset):
            if 0 <= k < len(allocs):
                size, freed = allocs[k]
                out.append((size, freed is not None and freed <= end - self.offset))
        return out

    def transients(self, allocs, start, end):
        """Sizes of what the span took and gave back: a kernel's workspaces."""
        return [size for size, freed in self.span(allocs, start, end) if freed]


# --- convolutions -----------------------------------------------------------------------------


def parse_config(config):
    kv = dict(p.split("=", 1) for p in config.split(";"))
    dims = lambda s: [int(x) for x in s.split("x")]
    return {
        "in": dims(kv["in"]),
        "w": dims(kv["w"]),
        "stride": dims(kv["stride"]),
        "pad": dims(kv["pad"]),
        "dil": dims(kv["dil"]),
        "groups": int(kv["groups"]),
        "dtype": kv["dtype"],
        "layout": kv["layout"],
        "transposed": kv.get("transposed") == "1",
        "opad": dims(kv["opad"]) if "opad" in kv else [0] * (len(dims(kv["in"])) - 1),
    }


def probe_convs(torch, configs, benchmark, deadline=None):
    """Runs each configuration's forward and both backward passes alone, twice, and reads the
    workspaces of the second round from the allocator's record. The first round is where
    cuDNN chooses (with ``benchmark``, its search: the trial workspaces are reported as
    ``search``)."""
    aten = torch.ops.aten
    torch.backends.cudnn.benchmark = benchmark
    rec = Allocations(torch)
    spans = []
    for c in configs:
        if deadline is not None and time.time() > deadline:
            break  # the rest stays unprobed; the caller notes how many were
        p = parse_config(c["config"])
        dtype = getattr(torch, p["dtype"])
        fmt = (
            {4: torch.channels_last, 5: torch.channels_last_3d}.get(len(p["in"]) + 1)
            if p["layout"] == "channels_last"
            else None
        )
        try:
            x = torch.randn([c["n"], *p["in"]], device="cuda", dtype=dtype)
            w = torch.randn(p["w"], device="cuda", dtype=dtype)
            if fmt is not None:
                x, w = x.to(memory_format=fmt), w.to(memory_format=fmt)
            args = (p["stride"], p["pad"], p["dil"], p["transposed"], p["opad"], p["groups"])
            rounds = []
            for _ in range(2):
                m = {}
                m["fwd"] = rec.mark()
                y = aten.convolution(x, w, None, *args)
                m["fwd_end"] = rec.mark()
                g = torch.randn_like(y)
                bias = [y.shape[1]]
                m["bwd_data"] = rec.mark()
                gi = aten.convolution_backward(g, x, w, None, *args, [True, False, False])[0]
                m["bwd_data_end"] = rec.mark()
                del gi
                m["bwd_filter"] = rec.mark()
                gw = aten.convolution_backward(g, x, w, None, *args, [False, True, False])[1]
                m["bwd_filter_end"] = rec.mark()
                del gw
                m["both"] = rec.mark()
                both = aten.convolution_backward(g, x, w, bias, *args, [True, True, True])
                m["both_end"] = rec.mark()
                del both, y, g
                rounds.append(m)
            spans.append((c, rounds, None))
            del x, w
        except Exception as e:  # noqa: BLE001 - a configuration this GPU rejects is reported, not fatal
            spans.append((c, [], f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        torch.cuda.empty_cache()
    allocs = rec.stop()
    out = []
    for c, rounds, error in spans:
        row = {"config": c["config"], "n": c["n"]}
        if error:
            row["error"] = error
            out.append(row)
            continue
        first, last = rounds
        for d in ("fwd", "bwd_data", "bwd_filter"):
            row[d] = rec.transients(allocs, last[d], last[d + "_end"])
        # A whole backward (both gradients and the bias) as PyTorch orders its outputs and
        # workspaces: [size, freed inside].
        row["backward_sequence"] = rec.span(allocs, last["both"] + 1, last["both_end"])
        firsts = {
            d: rec.transients(allocs, first[d], first[d + "_end"])
            for d in ("fwd", "bwd_data", "bwd_filter")
        }
        if benchmark:
            row["search"] = {d: max(v or [0]) for d, v in firsts.items()}
        elif any(firsts[d] != row[d] for d in firsts):
            row["first"] = firsts
        out.append(row)
    return out


# --- context, cuBLAS, SDPA ---------------------------------------------------------------------


def device_used(torch):
    free, total = torch.cuda.mem_get_info()
    return total - free


def context_point(torch, name):
    """Device memory in use and PyTorch's reserved memory at a point of the probe: the
    difference is what lives outside the allocator (context and libraries)."""
    return {"at": name, "used": device_used(torch), "reserved": torch.cuda.memory_reserved()}


def probe_cublas(torch):
    """The first matmul on a fresh thread allocates that thread's cuBLAS workspace; linear with
    a bias takes the cuBLASLt path."""
    import threading

    rec = Allocations(torch)
    marks = {}
    a = torch.randn(256, 256, device="cuda")
    b = torch.randn(256, 256, device="cuda")
    bias = torch.randn(256, device="cuda")

    def run(name, f):
        start = rec.mark() + 1
        r = f()
        marks[name] = (start, rec.mark())
        del r

    for name, f in (
        ("mm", lambda: a @ b),
        ("addmm_lt", lambda: torch.nn.functional.linear(a, b, bias)),
    ):
        t = threading.Thread(target=run, args=(name, f))
        t.start()
        t.join()
    allocs = rec.stop()
    # Not the output (256×256 fp32) and kept: the workspace the thread holds on to.
    return {
        name: [
            size for size, freed in rec.span(allocs, s, e) if size != 256 * 256 * 4 and not freed
        ]
        for name, (s, e) in marks.items()
    }


SDPA_CASES = [
    (dt, d, mask, gqa)
    for dt in ("float16", "bfloat16", "float32")
    for d in (64, 128, 256)
    for mask in ("none", "causal", "additive")
    for gqa in (False, True)
]


def probe_sdpa(torch):
    """Which kernel ``F.scaled_dot_product_attention`` runs (forward + backward), read from the
    profiler's kernel names."""
    import torch.nn.functional as F

    # cuDNN's own attention kernels are named "cudnn_generated_..._sdpa_..._flash_...": look
    # for cuDNN first.
    names = {
        "cudnn": ("cudnn",),
        "flash": ("flash",),
        "efficient": ("efficient", "mem_eff", "fmha_cutlass"),
    }
    out = []
    for dt, d, mask, gqa in SDPA_CASES:
        dtype = getattr(torch, dt)
        b, h, s = 2, 8, 256
        kvh = 2 if gqa else h
        q = torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(b, kvh, s, d, device="cuda", dtype=dtype, requires_grad=True)
        v = torch.randn(b, kvh, s, d, device="cuda", dtype=dtype, requires_grad=True)
        attn = torch.zeros(b, 1, s, s, device="cuda", dtype=dtype) if mask == "additive" else None
        row = {"dtype": dt, "head_dim": d, "mask": mask, "gqa": gqa}
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                kw = {"enable_gqa": True} if gqa else {}
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=attn, is_causal=mask == "causal", **kw
                )
                o.sum().backward()
                torch.cuda.synchronize()
            kernels = sorted(
                {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
            )
            joined = " ".join(kernels).lower()
            row["kernels"] = [
                k[:120]
                for k in kernels
                if any(
                    w in k.lower()
                    for w in (
                        "attn",
                        "attention",
                        "fmha",
                        "flash",
                        "sdpa",
                        "cudnn",
                        "softmax",
                        "gemm",
                    )
                )
            ][:10]
            row["kernel"] = next(
                (n for n in ("cudnn", "flash", "efficient") if any(k in joined for k in names[n])),
                "math",
            )
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        out.append(row)
    return out


def probe_nccl(torch):
    """NCCL's memory outside the allocator, on this GPU: a one-rank NCCL group's first
    collective (NCCL's kernels and state loaded, its first communicator made), then a second
    group's (one more communicator). One rank has no peers to hold buffers for, so the
    second is a floor of a communicator's cost on a multi-GPU job (``ranks`` says so), while
    the first less the second is NCCL's own, whatever the ranks. None where this torch has no
    NCCL."""
    import tempfile

    dist = torch.distributed
    if not (dist.is_available() and dist.is_nccl_available()) or dist.is_initialized():
        return None
    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group(
            "nccl", store=dist.FileStore(f.name, 1), rank=0, world_size=1, device_id=0
        )
        try:
            x = torch.ones(1024, device="cuda")
            torch.cuda.synchronize()
            before = device_used(torch)
            dist.all_reduce(x)
            torch.cuda.synchronize()
            first = device_used(torch)
            dist.all_reduce(x, group=dist.new_group([0]))
            torch.cuda.synchronize()
            second = device_used(torch)
        finally:
            dist.destroy_process_group()
    communicator = max(0, second - first)
    return {
        "ranks": 1,
        "base_bytes": max(0, first - before - communicator),
        "communicator_bytes": communicator,
    }


def stack_facts(torch):
    props = torch.cuda.get_device_properties(0)
    facts = {
        "gpu": props.name,
        "capability": f"{props.major}.{props.minor}",
        "total_bytes": int(props.total_memory),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "cudnn": torch.backends.cudnn.version() or 0,
    }
    try:
        import pynvml

        pynvml.nvmlInit()
        facts["driver"] = pynvml.nvmlSystemGetDriverVersion()
        if isinstance(facts["driver"], bytes):
            facts["driver"] = facts["driver"].decode()
    except Exception:  # noqa: BLE001
        pass
    return facts


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpumem_trace.probe", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument(
        "--models",
        nargs="*",
        default=None,
        help="a measurement CSV or MODEL:BATCH[:PRECISION[:CxHxW]] items",
    )
    p.add_argument("--configs", help="JSON list of {config, n} (written by --list)")
    p.add_argument(
        "--list", action="store_true", help="only list the configurations (no GPU needed)"
    )
    p.add_argument("--benchmark", choices=["off", "on", "both"], default="both")
    p.add_argument("--no-sdpa", action="store_true")
    p.add_argument("--no-nccl", action="store_true")
    p.add_argument(
        "--seconds",
        type=float,
        default=0,
        help="time budget of each cudnn.benchmark mode's convolutions (0: none); configurations past it stay unprobed",
    )
    a = p.parse_args(argv)

    def fail(code, msg):
        print(f"gpumem_trace.probe: {msg}", file=sys.stderr)
        return code

    try:
        if a.configs:
            with open(a.configs) as f:
                configs = json.load(f)
        else:
            jobs = []
            for item in a.models or []:
                jobs += read_jobs(item) if item.endswith(".csv") else [parse_job(item)]
            configs = configs_of(jobs if a.models is not None else grid_jobs())
    except (OSError, ValueError, KeyError) as e:
        return fail(2, str(e))
    if a.list:
        with open(a.out, "w") as f:
            json.dump(configs, f, indent=1)
        return 0

    import torch

    if not torch.cuda.is_available():
        return fail(3, "no CUDA device (probe runs on the GPU it measures)")
    t0 = time.time()
    torch.empty(1, device="cuda")
    doc = {"stack": stack_facts(torch), "context": [context_point(torch, "cuda")]}

    def save():
        # After each part: a run cut short keeps what it measured.
        doc["seconds"] = round(time.time() - t0, 1)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)

    doc["cublas"] = probe_cublas(torch)
    doc["context"].append(context_point(torch, "cublas"))
    save()
    modes = {"off": [False], "on": [True], "both": [False, True]}[a.benchmark]
    doc["conv"] = {}
    for bench in modes:
        deadline = time.time() + a.seconds if a.seconds > 0 else None
        rows = probe_convs(torch, configs, bench, deadline)
        doc["conv"]["benchmark" if bench else "heuristic"] = rows
        if len(rows) < len(configs):
            doc.setdefault("unprobed", {})["benchmark" if bench else "heuristic"] = len(
                configs
            ) - len(rows)
        doc["context"].append(context_point(torch, "cudnn_benchmark" if bench else "cudnn"))
        save()
    torch.backends.cudnn.benchmark = False
    if not a.no_nccl:
        doc["nccl"] = probe_nccl(torch)
        save()
    if not a.no_sdpa:
        doc["sdpa"] = probe_sdpa(torch)
        doc["context"].append(context_point(torch, "sdpa"))
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
