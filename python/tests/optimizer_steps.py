"""What the real optimizers allocate, recorded event by event on meta tensors: each optimizer
gpumem names, built by its own library over meta parameters with meta gradients, stepped twice
(the first step makes the state), every new storage and its death recorded by a dispatch mode
of this file's own (not the tracer's).

The native families' step model is checked against these records (a fixture):

    cd python && python -m tests.optimizer_steps > ../crates/gpumem-core/tests/data/optimizer-steps.json

Each record: per step, the events (``["alloc", bytes, category]``, ``["free", k]`` for the
step's ``k``-th allocation), the state bytes (``optimizer_state``), the host-backed bytes
(bitsandbytes' paged states) and the most temporary bytes live at once. A step's allocation
that outlives it is state when the optimizer's state holds it (``host_backed`` when paged),
else ``leaked`` (which no optimizer does).
"""

import json
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Parameter shapes: 2-D (Muon's, Adafactor's factored), 1-D, 4-D; under and over bitsandbytes'
# 4096-element 8-bit threshold and its 100,000-element paging threshold; numbers of elements
# torchao's blocks divide (8192, 4608, 131072) and do not (5000, 21000).
SHAPES = [(64, 128), (64,), (32, 16, 3, 3), (5000,), (10, 10), (512, 256), (300, 70)]

# The optimizers the native families model (crates/gpumem-core/src/step/optimizer.rs).
NATIVE = [
    *(
        f"{a}{i}"
        for i in ("", "-for-loop", "-fused")
        for a in ("adam", "adamw", "sgd", "sgd-momentum")
    ),
    *(
        f"{paged}{a}{bits}"
        for paged in ("", "paged-")
        for bits in ("8bit", "32bit")
        for a in ("adam", "adamw", "lion")
    ),
    "torchao-adamw8bit",
    "torchao-adamw4bit",
    "torchao-adamw-fp8",
    "transformers-adamw",
]

aten = torch.ops.aten


class Allocations(TorchDispatchMode):
    """Every new meta storage an op makes, and when it dies."""

    def __init__(self):
        super().__init__()
        self.events = []
        self.live = {}  # storage key -> index of its allocation
        self.tensors = {}  # index of an allocation -> a weak reference to its storage's tensor
        self.allocs = 0

    def _free(self, key):
        k = self.live.pop(key, None)
        if k is not None:
            self.events.append(["free", k])

    def _track(self, t, inputs):
        if not isinstance(t, torch.Tensor) or t.device.type != "meta":
            return
        st = t.untyped_storage()
        # An input's storage (an in-place op's result, a view) is no new memory.
        if st._cdata in self.live or st._cdata in inputs or st.nbytes() == 0:
            return
        self.live[st._cdata] = self.allocs
        self.events.append(["alloc", st.nbytes()])
        self.allocs += 1
        weakref.finalize(st, self._free, st._cdata)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default and args[0].device.type == "meta":
            return 1.0  # a value (Adafactor's norms): sizes never depend on it
        out = func(*args, **kwargs)
        # `torch.tensor(data, device=...)` makes its tensor outside the dispatcher and hands
        # it over fresh: new memory.
        inputs = (
            set()
            if func is aten.lift_fresh.default
            else {
                t.untyped_storage()._cdata
                for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and t.device.type == "meta"
            }
        )
        for t in tree_leaves(out):
            self._track(t, inputs)
        return out


def _storage_keys(optimizer):
    from gpumem_trace.optimizers import state_tensors

    return {t.untyped_storage()._cdata: cat for t, cat in state_tensors(optimizer, "meta")}


TORCH = {
    "adam": ("Adam", {}),
    "adamw": ("AdamW", {}),
    "sgd": ("SGD", {}),
    "sgd-momentum": ("SGD", {"momentum": 0.9}),
    "adagrad": ("Adagrad", {}),
    "rmsprop": ("RMSprop", {}),
    "torch-adafactor": ("Adafactor", {}),
}
IMPLEMENTATIONS = {
    "-for-loop": {"foreach": False},
    "-fused": {"fused": True},
    "": {"foreach": True},
}


def real(name, params, lr=1e-3):
    """The real optimizer gpumem's name stands for, made here from its library (not by
    gpumem's tracer), and what its step runs under on meta tensors: torch's fused kernels
    admitted on meta; bitsandbytes' CUDA update kernel (in place) not run, its managed memory a
    meta tensor marked paged; torchao's state made as its step makes it (its compiled kernel,
    in place, not run)."""
    import contextlib

    from gpumem_trace import optimizers as plumbing

    for suffix, how in IMPLEMENTATIONS.items():
        base = name.removesuffix(suffix)
        if name.endswith(suffix) and base in TORCH:
            cls, kwargs = TORCH[base]
            opt = getattr(torch.optim, cls)(params, lr=lr, **kwargs, **how)
            if "fused" in how:
                plumbing._meta_in_place("_fused_sgd_", "_fused_adagrad_")
                return opt, plumbing.fused_on_meta
            return opt, contextlib.nullcontext
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(
            params, lr=lr, scale_parameter=False, relative_step=False
        ), contextlib.nullcontext
    if name == "transformers-adamw":
        # The installed transformers' own class where it still has one; else the tracer's
        # restatement (held to transformers' code by test_optimizers.py's own expectations).
        from gpumem_trace.optimizers import _transformers_adamw

        return _transformers_adamw(params, lr), contextlib.nullcontext
    if name == "muon":
        pair = [
            torch.optim.Muon([p for p in params if p.ndim == 2], lr=lr),
            torch.optim.AdamW([p for p in params if p.ndim != 2], lr=lr, foreach=True),
        ]
        return pair, contextlib.nullcontext
    if name.startswith("torchao-"):
        import torchao.optim

        cls = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit", "adamw-fp8": "AdamWFp8"}
        opt = getattr(torchao.optim, cls[name.removeprefix("torchao-")])(params, lr=lr)

        def step():
            for p in params:
                state = opt.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = opt._new_buffer(p, True)
                    state["exp_avg_sq"] = opt._new_buffer(p, False)
                state["step"] += 1

        opt.step = step
        return opt, plumbing.device_data_seen
    import bitsandbytes.optim

    paged, rest = name.startswith("paged-"), name.removeprefix("paged-")
    bits = "8bit" if rest.endswith("8bit") else "32bit"
    alg = rest.removesuffix(bits)
    cls = {"adam": "Adam", "adamw": "AdamW", "lion": "Lion"}[alg]
    opt = getattr(bitsandbytes.optim, f"{'Paged' if paged else ''}{cls}{bits}")(params, lr=lr)
    opt.update_step = lambda *a, **k: None
    return opt, plumbing._bnb_managed_on_meta


def record(name, shapes=SHAPES, dtype=torch.float32):
    """Two steps of the real optimizer gpumem calls ``name`` over parameters of ``shapes``,
    as recorded."""
    from gpumem_trace.optimizers import state_tensors

    params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype, device="meta")) for s in shapes]
    for p in params:
        p.grad = torch.zeros_like(p)
    made, around = real(name, params)
    parts = made if isinstance(made, list) else [made]

    class Both:  # Muon's pair, as one optimizer
        state = property(lambda self: {p: s for o in parts for p, s in o.state.items()})

    opt = Both()
    steps = []
    for _ in range(2):
        mode = Allocations()
        with mode, around():
            for o in parts:
                o.step()
        state = _storage_keys(opt)
        kept = {k: state.get(key, "leaked") for key, k in mode.live.items()}
        events, live, peak, n = [], 0, 0, 0
        sizes = {}
        for e in mode.events:
            if e[0] == "alloc":
                cat = kept.get(n, "temporary")
                events.append(["alloc", e[1], cat])
                if cat == "temporary":
                    sizes[n] = e[1]
                    live += e[1]
                    peak = max(peak, live)
                n += 1
            else:
                events.append(e)
                live -= sizes.pop(e[1], 0)
        made = {}
        for e in events:
            if e[0] == "alloc":
                made[e[2]] = made.get(e[2], 0) + e[1]
        held = {}
        for t, cat in state_tensors(opt, "meta"):
            held.setdefault(cat, {})[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        steps.append(
            {
                # What the state holds after the step (also what the constructor made).
                "held": {cat: sum(keys.values()) for cat, keys in sorted(held.items())},
                "events": events,
                "state_bytes": made.get("optimizer_state", 0),
                "host_backed_bytes": made.get("host_backed", 0),
                "leaked_bytes": made.get("leaked", 0),
                "peak_temporary_bytes": peak,
            }
        )
    return steps


def _version(package):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def main():
    import math

    out = {
        "command": "cd python && python -m tests.optimizer_steps > ../crates/gpumem-core/tests/data/optimizer-steps.json",
        "torch": torch.__version__,
        "bitsandbytes": _version("bitsandbytes"),
        "torchao": _version("torchao"),
        "params": [{"shape": list(s), "numel": math.prod(s)} for s in SHAPES],
        "optimizers": {name: record(name) for name in NATIVE},
    }
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
