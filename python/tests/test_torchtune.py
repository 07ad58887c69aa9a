"""torchtune's chunked cross-entropy and optimizer-in-backward, held to torchtune's own code.

gpumem uses torchtune's own ``CEWithChunkedOutputLoss`` and ``register_optim_in_bwd_hooks``
where torchtune imports, and restatements of them (gpumem_trace/losses.py, optimizers.py)
where it does not. These tests run both on the same meta tensors under the tracer and require
the same allocations, event by event. They need torchtune (0.6.1, beside torchtitan in the
environment scripts/test.sh makes); where it is not installed they are skipped with the reason,
unless GPUMEM_TEST_REQUIRE_TITAN=1 (CI), where its absence fails them."""

import importlib

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


@pytest.mark.parametrize("chunks", [1, 4, 8])
def test_chunked_cross_entropy_allocates_as_torchtune_does(chunks):
    own = importlib.import_module("torchtune.modules.loss").CEWithChunkedOutputLoss
    assert losses.loss_class() is own, "torchtune's own class where it imports"
    batch, seq, vocab = 2, 64, 1000

    def step(loss_cls):
        def run():
            hidden = torch.empty(
                batch, seq, 32, device=DEVICE, dtype=torch.bfloat16, requires_grad=True
            )
            head = torch.empty(vocab, 32, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
            logits = [part @ head.t() for part in hidden.chunk(chunks, dim=1)]
            labels = torch.empty(batch, seq, device=DEVICE, dtype=torch.long)
            loss = loss_cls(num_output_chunks=chunks)(logits, labels)
            del logits
            loss.backward()

        return recorded(run)

    theirs, ours = step(own), step(losses.ChunkedCrossEntropy)
    assert any(e[0] == "alloc" for e in theirs)
    assert ours == theirs


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
