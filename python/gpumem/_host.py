"""Live models: a ``torch.nn.Module`` the user holds, sized without touching it.

The model is registered under its fingerprint (``live:KEY``) in the tracer's table of live
models, and gpumem's core, asked to size ``live:KEY``, hands the trace back to this process
(``run``): it forks, and the fork — which has the model object — traces a meta copy of it and
exits. The user's process keeps its model, its weights and its state as they were; the fork's
imports, patches and allocations end with it. The same fingerprint names the same trace, so a
second estimate of the same architecture is answered from gpumem's trace cache."""

import contextlib
import hashlib
import inspect
import json
import os
import signal
import sys
import time
import traceback

import torch

from gpumem_trace import models as _models


def _source(cls):
    """The text of the class's forward, where Python has it: an edited forward is another model."""
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError, AttributeError):
        return ""


def fingerprint(module, example):
    """What makes two live models trace alike: their structure (``repr``), every parameter's and
    buffer's name, shape, dtype and trainability, each class's forward, the example batch's
    shapes and dtypes; hex."""
    h = hashlib.sha256()
    h.update(repr(module).encode())
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        h.update(f"{name}{tuple(t.shape)}{t.dtype}{t.requires_grad}".encode())
    for cls in sorted({type(m) for m in module.modules()}, key=lambda c: c.__qualname__):
        h.update(f"{cls.__module__}.{cls.__qualname__}".encode())
        h.update(_source(cls).encode())
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        h.update(config.to_json_string().encode())
    if example is not None:
        tensors = [example] if isinstance(example, torch.Tensor) else list(example)
        for t in tensors:
            h.update(f"{tuple(t.shape)}{t.dtype}".encode())
    return h.hexdigest()[:32]


def register(module, example):
    """The reference of ``module`` (with its example batch, or ``None``), registered."""
    if example is not None:
        tensors = [example] if isinstance(example, torch.Tensor) else list(example)
        if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in tensors):
            raise ValueError("input= must be a batch: a tensor, or a tuple of tensors, batch first")
    key = fingerprint(module, example)
    _models.LIVE[key] = (module, example)
    return f"live:{key}"


def run(request_json, log, deadline_s):
    """gpumem's core asks this process to trace a request: in a fork, its output into ``log``.
    The fork's exit code (negative: the signal that ended it), or ``None`` where it outlived
    ``deadline_s`` and was killed with all it forked."""
    from gpumem_trace.__main__ import answer

    request = json.loads(request_json)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.setpgid(0, 0)  # its own group: a timeout kills the tracer's forks with it
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = answer(request)
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)  # as the fork does: whichever runs first, the group exists
    end, done = time.monotonic() + deadline_s, 0
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            if time.monotonic() > end:
                return None
            time.sleep(0.005)
    finally:
        if not done:  # past the deadline, or this process interrupted: the fork ends too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
