"""Liger's kernels on a Hugging Face model, as the trainers switch them on, run as Liger's own code.

Hugging Face's Trainer and TRL (``use_liger_kernel``) call Liger's
``_apply_liger_kernel_to_instance`` on the model (the base model under PEFT) with
``liger_kernel_config``'s keywords; axolotl's plugin calls the function for the model's type with
each kernel its keys turn on. Both end in Liger's ``apply_liger_kernel_to_<type>``, which swaps the
model's RMSNorm, MLP, rotary embedding and ``forward`` for Liger's. Liger's kernels are Triton
launches, which do nothing on the meta device (``cuda.patches``): what is traced is what Liger's
Python allocates around them — each kernel's outputs and saved tensors, and for the fused linear
cross-entropy its gradient buffers (the hidden states' and the head's, made in forward and held
to backward) and one chunk of logits at a time, never the whole sequence's logits.
"""

import contextlib
import functools
import sys

from . import amp, standin
from .device import DEVICE
from .models import ReferenceError_


def apply(model, kernels, name):
    """Liger on ``model`` with ``kernels`` ({Liger's keyword: on}) over Liger's defaults."""
    try:
        from liger_kernel.transformers.monkey_patch import (
            MODEL_TYPE_TO_APPLY_LIGER_FN,
            _apply_liger_kernel_to_instance,
        )
    except ImportError as e:
        raise ReferenceError_(
            f"--liger: liger-kernel does not import in the tracer's Python ({e}); install it there (pip install liger-kernel)"
        ) from None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if model_type is None:
        raise ReferenceError_(
            f"{name}: Liger's kernels apply to Hugging Face models (hf:, a Hub id, a config.json); this one has no model type"
        )
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        # Liger itself only logs this and leaves the model as it is.
        raise ReferenceError_(
            f"{name}: Liger has no kernels for model type `{model_type}` (it has them for {', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))})"
        )
    # Liger passes on the keywords the model type's function takes and drops the others (a
    # GLU set both ways, as axolotl's is, reaches whichever of swiglu and geglu it has).
    _apply_liger_kernel_to_instance(model=base, **kernels)


@contextlib.contextmanager
def on_the_gpu(gpu, rec):
    """Inside, Liger's autograd functions run as on ``gpu``. Liger's Python picks its paths by
    what it asks: its tensors' device (``x.device.type == "cuda"``: the fused linear
    cross-entropy then reuses one logits buffer and accumulates the head's gradient in place,
    where elsewhere it allocates per chunk), the device's capability, and the autocast state. So
    each of its functions runs with meta tensors reading as ``cuda:0`` to Liger's own code (the
    tracer still sees meta), ``torch.cuda`` and the autocast queries answered as the GPU and the
    emulated autocast would, and its CUDA buffers made on meta and recorded."""
    import torch

    real_device = torch._C.TensorBase.device.__get__

    def device(t):
        d = real_device(t)
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if d.type == DEVICE and caller.startswith("liger_kernel"):
            return torch.device("cuda", 0)
        return d

    def autocast_enabled(device_type="cuda"):
        return device_type == "cuda" and amp.active_dtype() is not None

    def autocast_dtype(device_type="cuda"):
        return amp.active_dtype() or torch.float16

    depth = [0]  # a Liger function inside another (its backward calling a kernel's) nests

    @contextlib.contextmanager
    def scope():
        if depth[0]:
            yield
            return
        depth[0] += 1
        try:
            with (
                # Over TensorBase's, for Liger's frames alone.
                standin.patched(torch.Tensor, device=property(device)),
                standin.patched(
                    torch,
                    is_autocast_enabled=autocast_enabled,
                    get_autocast_dtype=autocast_dtype,
                    get_autocast_gpu_dtype=autocast_dtype,
                ),
                standin.device_calls(gpu, rec),
            ):
                yield
        finally:
            depth[0] -= 1

    def run(f):
        @functools.wraps(f)
        def wrapped(*args, **kwargs):
            with scope():
                return f(*args, **kwargs)

        return staticmethod(wrapped)

    saved = []
    for cls in _functions():
        for name in ("forward", "backward"):
            if isinstance(cls.__dict__.get(name), staticmethod):
                saved.append((cls, name, cls.__dict__[name]))
                setattr(cls, name, run(cls.__dict__[name].__func__))
    try:
        yield
    finally:
        for cls, name, f in saved:
            setattr(cls, name, f)


def _functions():
    """Liger's autograd functions (its kernels' Python), as far as they are imported."""
    import torch

    for name, module in list(sys.modules.items()):
        if name.startswith("liger_kernel.ops") and module is not None:
            for v in list(vars(module).values()):
                if (
                    isinstance(v, type)
                    and issubclass(v, torch.autograd.Function)
                    and v.__module__ == name
                ):
                    yield v
