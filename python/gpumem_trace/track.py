"""Your own training step, recorded: ``Tracker`` around the user's code (their loop, loss,
optimizers, ``GradScaler``, checkpointing) records what it allocates on the stand-in CUDA
(standin.py) into a trace like the loop's (loop.py), in the user's own process.

- On the way in, the model's parameters and buffers are moved onto the stand-in as a CPU→CUDA
  move makes them (recorded as the parameters), and the optimizers given are pointed at them,
  with empty state. On the way out every module gets back its own parameters and buffers, and
  every optimizer its parameters and state: the user's model and optimizers are as they were,
  whatever the code inside did or raised.
- Inside, "cuda" is the stand-in: a host tensor moved there is the input batch; what autograd's
  backward runs is the backward phase (the loop's: in-place gradient sums as on a GPU); a step
  of a given optimizer is the optimizer phase, its state labelled as such, and once every
  given optimizer has stepped an iteration ends. torch.optim's default implementation is the
  one it picks for CUDA tensors (foreach), not its CPU fallback.
- Values are placeholders: ``.item()`` of a stand-in tensor is zero (a ``GradScaler``'s
  finite check then always steps), so code whose memory depends on a value is not recorded
  as it would run.
"""

import collections
import contextlib
import importlib
import os
import signal
import tempfile
import threading
import time

import torch
from torch.overrides import TorchFunctionMode

from . import amp, cuda, optimizers, standin
from .device import DEVICE, to_device_keeping_ties
from .sdpa import Stack
from .tracer import ModulePaths, Recorder, TraceMode

PRODUCER = "gpumem_trace/0.1.0 (track)"


class Timeout(Exception):
    """The code inside outlived the tracker's deadline."""


@contextlib.contextmanager
def _foreach_on_meta():
    """torch.optim picks its implementation by the parameters' device: on CUDA, foreach. Here
    meta stands for CUDA while this is open."""
    mod = importlib.import_module("torch.optim.optimizer")
    devices = getattr(mod, "_get_foreach_kernels_supported_devices", None)
    if devices is None:
        yield
        return
    mod._get_foreach_kernels_supported_devices = lambda: [*devices(), DEVICE]
    try:
        yield
    finally:
        mod._get_foreach_kernels_supported_devices = devices


@contextlib.contextmanager
def _deadline(seconds):
    """``Timeout`` raised in this thread after ``seconds`` (the main thread only: Python runs
    signal handlers there; elsewhere there is no deadline)."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise Timeout(f"the tracked code outlived its deadline of {seconds:g} s")

    saved = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, saved)


def _placeholder(t):
    return False if t.dtype == torch.bool else 0 if not t.is_floating_point() else 0.0


class _Inputs(TorchFunctionMode):
    """A host tensor moved to the stand-in is the input batch; ``.item()`` of a stand-in
    tensor is a placeholder."""

    def __init__(self, tracker):
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func is torch.Tensor.item and t is not None and t.device.type == DEVICE:
            return _placeholder(t)
        if (
            func in (torch.Tensor.to, torch.Tensor.cuda)
            and t is not None
            and t.device.type != DEVICE
            and not isinstance(t, torch.nn.Parameter)
        ):
            return self.tracker.as_input(func, args, kwargs)
        return func(*args, **kwargs)


class Tracker:
    """Records the code run inside ``with Tracker(model, optimizers, gpu, deadline):``; then
    ``write(path)`` writes its trace."""

    def __init__(self, model, optimizers_, gpu, deadline_s=None, batch=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        self.model = model
        self.optimizers = list(optimizers_)
        self.gpu = gpu
        self.deadline_s = deadline_s
        self.batch = batch
        self.rec = Recorder()
        self.stepped = set()
        self.stack = None
        self.started = None
        self.seconds = None

    # -- what the code inside does -------------------------------------------------------

    def as_input(self, func, args, kwargs):
        with self.rec.labelled("input_batch"):
            out = func(*args, **kwargs)
        if self.batch is None and isinstance(out, torch.Tensor) and out.dim() > 0:
            if out.device.type == DEVICE:
                self.batch = int(out.shape[0])
        return out

    def _backward(self, real):
        def backward(*args, **kwargs):
            saved, self.rec.phase = self.rec.phase, "backward"
            try:
                return real(*args, **kwargs)
            finally:
                self.rec.phase = saved
                for p in self.model.parameters():
                    if p.grad is not None:
                        self.rec.relabel(p.grad, "gradient")

        return backward

    def _step_begins(self, optimizer, args, kwargs):
        if any(o is optimizer for o in self.optimizers):
            self.rec.phase = "optimizer"

    def _step_ends(self, optimizer, args, kwargs):
        if not any(o is optimizer for o in self.optimizers):
            return
        for t, category in optimizers.state_tensors(optimizer, DEVICE):
            self.rec.relabel(t, category)
        self.rec.phase = "forward"
        self.stepped.add(id(optimizer))
        if len(self.stepped) == len(self.optimizers):
            self.stepped.clear()
            self.rec.iteration_end()

    # -- in and out ----------------------------------------------------------------------

    def _swap_in(self):
        """The model onto the stand-in, the optimizers onto its parameters (empty state)."""
        modules = list(self.model.modules())
        self.saved_modules = [(m, dict(m._parameters), dict(m._buffers)) for m in modules]
        self.saved_optimizers = [
            (o, o.state, [list(g["params"]) for g in o.param_groups]) for o in self.optimizers
        ]
        old = [(m, n, p) for m in modules for n, p in m._parameters.items() if p is not None]
        self.rec.phase = "setup"
        to_device_keeping_ties(self.model, device="cuda")  # the stand-in's, recorded
        moved = {id(p): m._parameters[n] for m, n, p in old}
        for o in self.optimizers:
            o.state = collections.defaultdict(dict)
            for g in o.param_groups:
                g["params"] = [moved.get(id(p), p) for p in g["params"]]
        self.rec.phase = "forward"

    def _swap_out(self):
        for m, params, buffers in self.saved_modules:
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)
        for o, state, groups in self.saved_optimizers:
            o.state = state
            for g, params in zip(o.param_groups, groups):
                g["params"] = params

    def __enter__(self):
        self.started = time.time()
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(_deadline(self.deadline_s))
            stack.enter_context(cuda.patches(Stack.here(self.gpu.capability_text)))
            stack.enter_context(amp.model_autocast_calls())
            stack.enter_context(_foreach_on_meta())
            stack.enter_context(optimizers.fused_on_meta())
            stack.enter_context(
                standin.patched(torch.autograd, backward=self._backward(torch.autograd.backward))
            )
            hooks = importlib.import_module("torch.optim.optimizer")
            stack.callback(hooks.register_optimizer_step_pre_hook(self._step_begins).remove)
            stack.callback(hooks.register_optimizer_step_post_hook(self._step_ends).remove)
            paths = ModulePaths(self.model)
            stack.enter_context(paths)
            stack.enter_context(TraceMode(self.rec, paths, DEVICE))
            stack.enter_context(standin.cuda(self.gpu.standin, self.rec))
            self._swap_in()
            stack.callback(self._swap_out)
            stack.enter_context(_Inputs(self))  # after the model's move: its buffers are no input
        except BaseException:
            stack.close()
            raise
        self.stack = stack
        return self

    def __exit__(self, *exc):
        stack, self.stack = self.stack, None
        self.rec.closed = True  # what dies with the stand-in's tensors is not the step's
        stack.close()
        self.seconds = time.time() - self.started
        return False

    def write(self, path):
        """The trace of what ran inside, as the tracer writes one (docs/trace-format.md)."""
        header = {
            "model": f"track:{type(self.model).__name__}",
            "batch_size": self.batch or 1,
            "options": {},
            "producer": PRODUCER,
            "framework": f"torch {torch.__version__}",
            "parameters": sum(
                p.numel()
                for p in {
                    id(p): p
                    for _, ps, _ in self.saved_modules
                    for p in ps.values()
                    if p is not None
                }.values()
                if p.requires_grad
            ),
            "trace_seconds": round(self.seconds or 0.0, 3),
        }
        self.rec.write(path, header)
        return header


class Gpu:
    """The GPU the stand-in answers as: its built-in profile's name, display name, compute
    capability and memory."""

    def __init__(self, display, capability, capacity_mib):
        self.capability_text = capability
        major, minor = (int(x) for x in capability.split("."))
        self.standin = standin.StandinGpu(
            name=display, total_memory=int(capacity_mib) << 20, capability=(major, minor)
        )


def trace_text(tracker):
    """The tracker's trace as text."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "track.jsonl")
        tracker.write(path)
        with open(path) as f:
            return f.read()
