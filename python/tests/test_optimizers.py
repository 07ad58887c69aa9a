"""Acceptance of gpumem's optimizers: for every optimizer and implementation gpumem names, the
state and the step's temporaries in gpumem's trace equal what the real optimizer allocates,
recorded event by event on meta tensors by a dispatch mode of the test's own
(tests/optimizer_steps.py) over two steps (the first makes the state). The native families'
model is held to the same records in Rust (crates/gpumem-core/tests/optimizers.rs)."""

import json
import warnings
from pathlib import Path

import pytest

HERE = Path(__file__).parent
FIX = HERE / "fixtures" / "user_models.py"
FIXTURE = HERE.parent.parent / "crates" / "gpumem-core" / "tests" / "data" / "optimizer-steps.json"

pytest.importorskip("torch")
from optimizer_steps import NATIVE, record  # noqa: E402

from gpumem_trace import loop  # noqa: E402
from gpumem_trace.optimizers import OPTIMIZERS  # noqa: E402

NEEDS = {"torchao": "torchao", "8bit": "bitsandbytes", "32bit": "bitsandbytes", "adafactor": None}


def _available(name):
    import importlib.util

    import torch

    for key, module in NEEDS.items():
        if key in name and module and importlib.util.find_spec(module) is None:
            return f"needs {module}"
    if name == "adafactor" and importlib.util.find_spec("transformers") is None:
        return "needs transformers"
    if name.startswith("torch-adafactor") and not hasattr(torch.optim, "Adafactor"):
        return f"torch {torch.__version__} has no Adafactor"
    if name == "muon" and not hasattr(torch.optim, "Muon"):
        return f"torch {torch.__version__} has no Muon"
    return None


def traced_steps(name, tmp_path):
    """gpumem's trace of a model with the record's parameter shapes, trained with ``name``: per
    iteration, the most temporary bytes live at once in the optimizer's step; and the state
    live at the end, by category."""
    out = tmp_path / f"{name}.jsonl"
    opts = loop.TraceOptions(
        model=f"py:{FIX}:optimizer_shapes", batch=2, optimizer=name, every_iteration=True
    )
    opts.iterations = 2
    loop.trace_training(opts, str(out))
    events = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    sizes, live, peaks, temp, peak = {}, {}, [], 0, 0
    for e in events:
        if e["ev"] == "alloc":
            sizes[e["id"]] = e
            live[e["id"]] = e
            if e["phase"] == "optimizer" and e["category"] == "temporary":
                temp += e["bytes"]
                peak = max(peak, temp)
        elif e["ev"] == "free":
            a = live.pop(e["id"])
            if a["phase"] == "optimizer" and a["category"] == "temporary":
                temp -= a["bytes"]
        elif e["ev"] == "iteration":
            peaks.append(peak)
            peak = 0
    held = {}
    for a in live.values():
        if a["category"] in ("optimizer_state", "host_backed"):
            held[a["category"]] = held.get(a["category"], 0) + a["bytes"]
    return peaks, held


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_trace_holds_and_allocates_what_the_real_optimizer_does(name, tmp_path):
    why = _available(name)
    if why:
        pytest.skip(why)
    warnings.filterwarnings("ignore")
    real = record(name)
    peaks, held = traced_steps(name, tmp_path)
    assert [s["leaked_bytes"] for s in real] == [0, 0]
    assert peaks == [s["peak_temporary_bytes"] for s in real], name
    assert held == real[-1]["held"], name


def test_the_fixture_is_what_this_torch_records():
    """The native model's fixture is today's record (on the torch it was recorded with)."""
    import torch

    fixture = json.loads(FIXTURE.read_text())
    if fixture["torch"] != torch.__version__:
        pytest.skip(f"recorded on torch {fixture['torch']}")
    for name in NATIVE:
        if _available(name):
            continue
        got = record(name)
        assert got == fixture["optimizers"][name], name


def test_the_implementations_of_adam_differ_as_torchs_do():
    """for-loop: each parameter's temporaries (the largest one's two beside the previous
    one's quotient); foreach: one list-wide temporary per parameter; fused: none."""
    import math

    from optimizer_steps import SHAPES

    sizes = [4 * math.prod(s) for s in SHAPES]
    peak = {
        n: record(n)[1]["peak_temporary_bytes"] for n in ("adam", "adam-for-loop", "adam-fused")
    }
    big = sizes.index(max(sizes))
    assert peak == {
        "adam": sum(sizes),
        "adam-for-loop": 2 * sizes[big] + sizes[big - 1],
        "adam-fused": 0,
    }


def test_the_tracer_builds_exactly_the_optimizers_gpumem_names():
    """One vocabulary: the request's schema (generated from the Rust type) lists the names the
    tracer builds, no more, no fewer."""
    schema = json.loads((HERE.parent / "gpumem_trace" / "request.schema.json").read_text())

    def find(node):
        if isinstance(node, dict):
            if "optimizer" in node.get("properties", {}):
                return node["properties"]["optimizer"]["enum"]
            for v in node.values():
                if (found := find(v)) is not None:
                    return found
        return None

    assert find(schema) == list(OPTIMIZERS)


def test_transformers_adamw_steps_one_parameter_at_a_time():
    """transformers' AdamW (``adamw_hf``) as its step reads (transformers 4.46,
    src/transformers/optimization.py, ``AdamW.step``): per parameter its two moments where it has
    none, then ``denom = exp_avg_sq.sqrt().add_(eps)``, which dies when the next parameter's
    replaces it. torch's for-loop makes every state first, and two temporaries per parameter."""
    import math

    from optimizer_steps import SHAPES

    sizes = [4 * math.prod(s) for s in SHAPES]

    def expected(first):
        events, n, denom = [], 0, None
        for b in sizes:
            if first:
                events += [["alloc", b, "optimizer_state"], ["alloc", b, "optimizer_state"]]
                n += 2
            events.append(["alloc", b, "temporary"])
            if denom is not None:
                events.append(["free", denom])
            denom, n = n, n + 1
        return events + [["free", denom]]

    steps = record("transformers-adamw")
    assert [s["events"] for s in steps] == [expected(True), expected(False)]
    pairs = max(a + b for a, b in zip(sizes, sizes[1:]))
    assert [s["peak_temporary_bytes"] for s in steps] == [pairs, pairs]
    assert steps[0]["state_bytes"] == 2 * sum(sizes)
    loop_first = record("adamw-for-loop")[0]["events"]
    assert all(e[2] == "optimizer_state" for e in loop_first[: 2 * len(sizes)])
