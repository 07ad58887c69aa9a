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
- Values are placeholders. Read by the user's own code, ``.item()`` is a ``Placeholder``
  (printed as ``?``, NaN as a float; ``.tolist()`` and ``.numpy()`` give them in the tensor's
  shape) and a branch, index or size decided by a value stops the
  run with ``ValueDecides``, naming the line; read by an installed library (transformers'
  packed-sequence check), the tracer answers as inside a model (tracer.data_dependent). A
  ``GradScaler`` steps as in a healthy run (its inf/NaN check has no value here).
"""

import collections
import contextlib
import importlib
import math
import os
import signal
import sys
import sysconfig
import tempfile
import threading
import time
import traceback

import numpy as np
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


class ValueDecides(BaseException):
    """A value computed on the stand-in decides something (a branch, a size): its real value is
    unknown, so the run stops here (a BaseException: a script's ``except Exception`` does not
    swallow it)."""

    def __init__(self, what):
        self.where = user_line()
        super().__init__(
            f"a value computed on the GPU {what}: on the stand-in CUDA values are placeholders "
            f"(at {self.where or 'an unknown line'})"
        )


def _caller():
    """The innermost frame outside torch, this tracer and the gpumem package."""
    ours = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
    ours += tuple(os.path.dirname(m.__file__) for m in [sys.modules.get("gpumem")] if m)
    frames = [f for f in traceback.extract_stack() if not f.filename.startswith(ours)]
    return frames[-1] if frames else None


def user_line():
    """``file:line`` of the code that asked (``_caller``)."""
    f = _caller()
    return f"{f.filename}:{f.lineno}" if f else None


_LIBRARIES = tuple(
    {
        sysconfig.get_paths()[k]
        for k in ("stdlib", "purelib", "platlib")
        if k in sysconfig.get_paths()
    }
)


def _asked_by_user_code():
    """Whether the user's own code reads the value (not an installed library's: there the
    tracer answers as it does inside a model, with a plausible value, tracer.data_dependent)."""
    f = _caller()
    if f is None:
        return False
    return not (f.filename.startswith(_LIBRARIES) or "-packages" + os.sep in f.filename)


class Placeholder:
    """A value computed on the stand-in (``.item()``): printed as ``?``, carried through
    arithmetic and comparisons; used to decide a branch, an index or a size, it stops the run
    with ``ValueDecides``; as a float it is NaN (for logging)."""

    __slots__ = ()

    def _same(self, *_):
        return self

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _same
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __pow__ = _same
    __neg__ = __pos__ = __abs__ = __round__ = _same
    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = _same
    __hash__ = object.__hash__

    def __bool__(self):
        raise ValueDecides("decides a branch")

    def __index__(self):
        raise ValueDecides("is used as a whole number (an index or a size)")

    __int__ = __index__

    def __float__(self):
        return math.nan

    def __format__(self, spec):
        return "?"

    def __repr__(self):
        return "?"


# The most values a tensor read whole to the host becomes placeholders of (one reference each).
MOST_PLACEHOLDERS = 1 << 22


def _placeholders(t, as_list):
    """``t.tolist()`` / ``t.numpy()`` of a stand-in tensor: placeholders of its shape."""
    if t.numel() > MOST_PLACEHOLDERS:
        raise ValueDecides(f"is read whole to the host ({t.numel()} values)")
    values = np.full(tuple(t.shape), Placeholder(), dtype=object)
    return values.tolist() if as_list else values


# What reads a tensor's value.
_READS = (
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.item,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.__float__,
    torch.Tensor.__format__,
)


class _Values(TorchFunctionMode):
    """A host tensor moved to the stand-in is the input batch; what would read a stand-in
    tensor's value gets a placeholder, or stops where the value would decide something."""

    def __init__(self, recording):
        super().__init__()
        self.recording = recording

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if t is not None and t.device.type == DEVICE and func in _READS and _asked_by_user_code():
            if func is torch.Tensor.item:
                return Placeholder()
            if func is torch.Tensor.__bool__:
                raise ValueDecides("decides a branch")
            if func in (torch.Tensor.__int__, torch.Tensor.__index__):
                raise ValueDecides("is used as a whole number (an index or a size)")
            if func is torch.Tensor.__float__:
                return math.nan
            if func is torch.Tensor.__format__:
                return "?" if t.dim() == 0 else func(*args, **kwargs)
            if func in (torch.Tensor.tolist, torch.Tensor.numpy):
                return _placeholders(t, func is torch.Tensor.tolist)
        if (
            func in (torch.Tensor.to, torch.Tensor.cuda)
            and t is not None
            and self.recording.rec.phase != "setup"  # a module's own tensors, moving with it
            and t.device.type != DEVICE
            and not isinstance(t, torch.nn.Parameter)
        ):
            return self.recording.as_input(func, args, kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _grad_scaler_steps():
    """A ``GradScaler`` skips the step whose gradients hold an inf or NaN, a value the stand-in
    does not have: it steps, as it does in a healthy run."""
    scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if scaler is None or not hasattr(scaler, "_maybe_opt_step"):
        yield
        return

    def step(self, optimizer, optimizer_state, *args, **kwargs):
        return optimizer.step(*args, **kwargs)

    with standin.patched(scaler, _maybe_opt_step=step):
        yield


class Recording:
    """What the code run inside ``with`` allocates on the stand-in CUDA, as a trace; ``write``
    writes it. Subclasses say whose parameters and optimizers are the job's."""

    def __init__(self, gpu, deadline_s=None, batch=None):
        self.gpu = gpu
        self.deadline_s = deadline_s
        self.batch = batch
        self.rec = Recorder()
        self.stack = None
        self.paths = None
        self.started = None
        self.seconds = None

    # What subclasses decide.
    def _modules(self):
        """The modules whose gradients are the job's."""
        raise NotImplementedError

    def _owns(self, optimizer):
        raise NotImplementedError

    def _stepped(self, optimizer):
        """After a step of an optimizer it owns."""

    def _backward_done(self):
        """After a backward pass."""

    def _setup(self, stack):
        """Once the stand-in is up, before the code inside runs."""

    def model_name(self):
        raise NotImplementedError

    # What the code inside does.
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
                out = real(*args, **kwargs)
            finally:
                self.rec.phase = saved
            for m in self._modules():
                for p in m.parameters():
                    if p.grad is not None:
                        self.rec.relabel(p.grad, "gradient")
            self._backward_done()
            return out

        return backward

    def _step_begins(self, optimizer, args, kwargs):
        if self._owns(optimizer):
            self.rec.phase = "optimizer"

    def _step_ends(self, optimizer, args, kwargs):
        if not self._owns(optimizer):
            return
        for t, category in optimizers.state_tensors(optimizer, DEVICE):
            self.rec.relabel(t, category)
        self.rec.phase = "forward"
        self._stepped(optimizer)

    def __enter__(self):
        self.started = time.time()
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(_deadline(self.deadline_s))
            stack.enter_context(cuda.patches(Stack.here(self.gpu.capability_text)))
            stack.enter_context(amp.model_autocast_calls())
            stack.enter_context(_foreach_on_meta())
            stack.enter_context(optimizers.fused_on_meta())
            stack.enter_context(_grad_scaler_steps())
            stack.enter_context(
                standin.patched(torch.autograd, backward=self._backward(torch.autograd.backward))
            )
            hooks = importlib.import_module("torch.optim.optimizer")
            stack.callback(hooks.register_optimizer_step_pre_hook(self._step_begins).remove)
            stack.callback(hooks.register_optimizer_step_post_hook(self._step_ends).remove)
            paths = self.paths = ModulePaths(self._paths_root())
            stack.enter_context(paths)
            stack.enter_context(TraceMode(self.rec, paths, DEVICE))
            stack.enter_context(standin.cuda(self.gpu.standin, self.rec))
            self.rec.phase = "setup"
            self._setup(stack)
            self.rec.phase = "forward"
            stack.enter_context(_Values(self))  # after the setup: a model's buffers are no input
        except BaseException:
            stack.close()
            raise
        self.stack = stack
        return self

    def _paths_root(self):
        return torch.nn.Module()

    def __exit__(self, *exc):
        stack, self.stack = self.stack, None
        self.rec.closed = True  # what dies with the stand-in's tensors is not the step's
        stack.close()
        self.seconds = time.time() - self.started
        return False

    def write(self, path):
        """The trace of what ran inside, as the tracer writes one (docs/trace-format.md)."""
        params = {id(p): p for m in self._modules() for p in m.parameters()}
        header = {
            "model": self.model_name(),
            "batch_size": self.batch or 1,
            "options": {},
            "producer": PRODUCER,
            "framework": f"torch {torch.__version__}",
            "parameters": sum(p.numel() for p in params.values() if p.requires_grad),
            "trace_seconds": round(self.seconds or 0.0, 3),
        }
        self.rec.write(path, header)
        return header


class Tracker(Recording):
    """``with Tracker(model, optimizers, gpu, deadline):`` around the user's own step: the
    model's parameters and buffers moved onto the stand-in on the way in (recorded as the
    parameters), the optimizers pointed at them with empty state; both as they were on the way
    out. An iteration ends once each optimizer has stepped."""

    def __init__(self, model, optimizers_, gpu, deadline_s=None, batch=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        super().__init__(gpu, deadline_s, batch)
        self.model = model
        self.optimizers = list(optimizers_)
        self.stepped = set()

    def model_name(self):
        return f"track:{type(self.model).__name__}"

    def _paths_root(self):
        return self.model

    def _modules(self):
        return [self.model]

    def _owns(self, optimizer):
        return any(o is optimizer for o in self.optimizers)

    def _stepped(self, optimizer):
        self.stepped.add(id(optimizer))
        if len(self.stepped) == len(self.optimizers):
            self.stepped.clear()
            self.rec.iteration_end()

    def _setup(self, stack):
        """The model onto the stand-in, the optimizers onto its parameters (empty state)."""
        modules = list(self.model.modules())
        saved_modules = [(m, dict(m._parameters), dict(m._buffers)) for m in modules]
        saved_optimizers = [
            (o, o.state, [list(g["params"]) for g in o.param_groups]) for o in self.optimizers
        ]

        def swap_out():
            for m, params, buffers in saved_modules:
                m._parameters.clear()
                m._parameters.update(params)
                m._buffers.clear()
                m._buffers.update(buffers)
            for o, state, groups in saved_optimizers:
                o.state = state
                for g, params in zip(o.param_groups, groups):
                    g["params"] = params

        stack.callback(swap_out)
        old = [(m, n, p) for m in modules for n, p in m._parameters.items() if p is not None]
        to_device_keeping_ties(self.model, device="cuda")  # the stand-in's, recorded
        moved = {id(p): m._parameters[n] for m, n, p in old}
        for o in self.optimizers:
            o.state = collections.defaultdict(dict)
            for g in o.param_groups:
                g["params"] = [moved.get(id(p), p) for p in g["params"]]


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
