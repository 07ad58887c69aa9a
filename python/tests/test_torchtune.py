"""torchtune's chunked cross-entropy and optimizer-in-backward, held to torchtune's own code.

gpumem uses torchtune's own ``CEWithChunkedOutputLoss`` and ``register_optim_in_bwd_hooks``
where torchtune imports, and restatements of them (gpumem_trace/losses.py, optimizers.py)
where it does not. These tests run both on the same meta tensors under the tracer and require
the same allocations, event by event. They need torchtune (0.6.1, beside torchtitan in the
environment scripts/test.sh makes); where it is not installed they are skipped with the reason,
unless GPUMEM_TEST_REQUIRE_TITAN=1 (CI), where its absence fails them."""

import importlib
import json

import pytest
import torch
from trainers import requires

from gpumem_trace import losses, optimizers
from gpumem_trace.device import DEVICE
from gpumem_trace.tracer import ModulePaths, Recorder, TraceMode

pytestmark = requires("torchtune")


def recorded(step):
    """The allocations and frees ``step`` makes on the trace's device: (event, bytes, op)."""
    rec = Recorder()
    rec.phase = "forward"
    with TraceMode(rec, ModulePaths(torch.nn.Module()), DEVICE):
        step()
    return [
        (e["ev"], e.get("bytes"), e.get("op")) for e in rec.events if e["ev"] in ("alloc", "free")
    ]


def chunked_loss_step(loss_fn, chunks, batch=2, seq=64, vocab=1000):
    """The allocations of a step of ``loss_fn`` (a chunked cross-entropy) on a model's logits
    taken per slice, the logits dropped before backward as torchtune's recipes drop them."""

    def run():
        hidden = torch.empty(
            batch, seq, 32, device=DEVICE, dtype=torch.bfloat16, requires_grad=True
        )
        head = torch.empty(vocab, 32, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        logits = [part @ head.t() for part in hidden.chunk(chunks, dim=1)]
        labels = torch.empty(batch, seq, device=DEVICE, dtype=torch.long)
        loss = loss_fn(logits, labels)
        del logits
        loss.backward()

    return recorded(run)


@pytest.mark.parametrize("chunks", [1, 4, 8])
def test_chunked_cross_entropy_allocates_as_torchtune_does(chunks):
    own = importlib.import_module("torchtune.modules.loss").CEWithChunkedOutputLoss
    assert losses.loss_class() is own, "torchtune's own class where it imports"
    theirs = chunked_loss_step(own(num_output_chunks=chunks), chunks)
    ours = chunked_loss_step(losses.ChunkedCrossEntropy(num_output_chunks=chunks), chunks)
    assert any(e[0] == "alloc" for e in theirs)
    assert ours == theirs


def test_compiled_chunked_cross_entropy_is_torchtunes_compile_loss():
    """``--compile`` with ``--chunked-ce``: torchtune's own ``compile_loss`` compiles each
    slice's ``compute_cross_entropy`` (through gpumem's stand-in for ``torch.compile``), and
    the restatement compiled the same way allocates the same, event by event — neither the
    slices' fp32 log-probabilities."""
    from gpumem_trace.compiled import Compiled, torch_compile

    own = importlib.import_module("torchtune.modules.loss").CEWithChunkedOutputLoss
    compile_loss = importlib.import_module("torchtune.training").compile_loss
    chunks = 4
    theirs = own(num_output_chunks=chunks)
    with torch_compile():
        compile_loss(theirs, verbose=False)
    assert isinstance(theirs.compute_cross_entropy, Compiled)
    ours = losses.ChunkedCrossEntropy(num_output_chunks=chunks)
    ours.compute_cross_entropy = Compiled(ours.compute_cross_entropy)
    events = chunked_loss_step(theirs, chunks)
    assert events == chunked_loss_step(ours, chunks)
    assert not [e for e in events if e[2] in ("_log_softmax", "_log_softmax_backward_data")]
    assert [e for e in events if e[2] == "amax"]


def test_optimizer_in_backward_hooks_as_torchtune_registers_them(monkeypatch):
    def step(use_torchtune):
        if not use_torchtune:
            real = importlib.import_module

            def without_torchtune(name, *a):
                if name.startswith("torchtune"):
                    raise ImportError(name)
                return real(name, *a)

            monkeypatch.setattr(optimizers.importlib, "import_module", without_torchtune)

        def run():
            layers = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)).to(DEVICE)
            opt = optimizers.InBackward(
                list(layers.parameters()), lambda ps: torch.optim.AdamW(ps, foreach=False)
            )
            x = torch.empty(4, 16, device=DEVICE)
            layers(x).sum().backward()
            assert all(p.grad is None for p in layers.parameters()), "each gradient freed"
            assert len(opt.state) == 4

        events = recorded(run)
        monkeypatch.undo()
        return events

    theirs, ours = step(True), step(False)
    assert any(e[0] == "alloc" for e in theirs)
    assert ours == theirs


def _trace(tmp_path, name, **options):
    from gpumem_trace.loop import TraceOptions, trace_training

    out = tmp_path / f"{name}.jsonl"
    trace_training(
        TraceOptions(
            model="torchtitan:llama3(flavor=debugmodel)",
            batch=4,
            seq_len=1024,
            precision="bf16",
            iterations=1,
            **options,
        ),
        out,
    )
    return [json.loads(line) for line in out.read_text().splitlines()[1:]]


def _live_when_backward_starts(events):
    live = {}
    for e in events:
        if e["ev"] == "alloc":
            if e["phase"] == "backward":
                break
            live[e["id"]] = e["bytes"]
        elif e["ev"] == "free":
            live.pop(e["id"], None)
    return sum(live.values())


def test_activation_offloading_runs_torchtunes_own_hooks(tmp_path):
    """--activation-offloading: torchtune's OffloadActivations around the model's forward. What
    forward saves goes to the host (no GPU allocation), but for the last few copies still in
    flight (its forward stash), the output head's (a NoOpManager) and tensors under 1 KiB; in
    backward each comes back as a new GPU tensor on torchtune's side stream (its own allocator
    pool), freed once its node has run."""
    from gpumem_trace.offload import OFFLOAD_STREAMS

    plain = _trace(tmp_path, "plain")
    offloaded = _trace(tmp_path, "offloaded", activation_offloading=True)
    kept, held = _live_when_backward_starts(plain), _live_when_backward_starts(offloaded)
    assert held < kept / 3, (held, kept)
    back = [
        e
        for e in offloaded
        if e["ev"] == "alloc" and e.get("stream") == OFFLOAD_STREAMS and e["phase"] == "backward"
    ]
    assert sum(e["bytes"] for e in back) >= (kept - held) / 2
    assert not any(
        e.get("stream") == OFFLOAD_STREAMS for e in offloaded if e.get("phase") == "forward"
    )
