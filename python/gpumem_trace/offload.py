"""Activation offloading as torchtune runs it (``enable_activation_offloading``), by torchtune's
own ``OffloadActivations``.

torchtune's recipes wrap the model's forward (not the loss) in the context
``get_act_offloading_ctx_manager`` returns: saved-tensor hooks that copy each saved activation of
at least 1 KiB (not a parameter or buffer) to pinned host memory on a side stream, keep the last
few on the GPU until their copies are done (``max_fwd_stash_size``), and in backward bring each
back on the side stream, freeing it once its autograd node has run. The output head runs
without offloading (a ``NoOpManager`` around ``model.output``; torchtune warns and offloads it
where a model has none — a Hugging Face model's head is ``lm_head``, which gpumem treats as
torchtune's ``output``).

On the meta device: the streams are ``distributed._MetaStream``s (everything in order, so a
stream's event has always happened — as on a GPU whose copies keep up); host tensors are meta
tensors the recorder counts as the host's; a host tensor moved to the GPU is a new GPU tensor
(``.to`` of meta onto meta would return it as it is); ``record_stream`` does nothing.
"""

import contextlib
import itertools

import torch

from . import distributed, standin
from .device import DEVICE
from .models import ReferenceError_


@contextlib.contextmanager
def on_meta(model, name, rec):
    """Inside, torchtune's offloading runs on the meta device (see the module's doc); yields
    torchtune's context for ``model``, which the loop's forward runs in."""
    try:
        from torchtune.training import NoOpManager, get_act_offloading_ctx_manager
    except ImportError as e:
        raise ReferenceError_(
            f"{name}: --activation-offloading runs torchtune's OffloadActivations, which does not import in the tracer's Python ({e}); install torchtune there"
        ) from None
    device = distributed._MetaDevice(on_stream=lambda stream_id: setattr(rec, "stream", stream_id))
    # Its side stream is numbered apart from FSDP2's (each stream its own allocator pool).
    device.made = itertools.count(OFFLOAD_STREAMS)
    with (
        standin.patched(
            torch.cuda,
            default_stream=lambda device_=None: device.DEFAULT,
            current_stream=device.current_stream,
            Stream=device.Stream,
            stream=device.stream,
            Event=distributed._MetaStream,
        ),
        standin.patched(torch, empty_like=_host_empty_like(rec, torch.empty_like)),
        standin.patched(
            torch.Tensor,
            to=_host_moves(rec, torch.Tensor.to),
            record_stream=lambda t, stream: None,
        ),
    ):
        head = getattr(model, "get_output_embeddings", lambda: None)()
        if getattr(model, "output", None) is None and head is not None:
            # What torchtune does for its own models' `output`: the head's activations stay.
            noop = NoOpManager()
            head.register_forward_pre_hook(lambda *_: noop.__enter__())
            head.register_forward_hook(lambda *_: noop.__exit__(), always_call=True)
        yield get_act_offloading_ctx_manager(model, True)


# The first stream id of offloading's streams (FSDP2's count from 1).
OFFLOAD_STREAMS = 1000


def _host_empty_like(rec, real):
    """``torch.empty_like`` where a GPU tensor's host copy is made (a meta tensor onto the CPU,
    pinned or not): a meta tensor the recorder counts as the host's. Patched as a function, not
    seen by a mode: the pack hook runs inside the op whose tensor it saves, where no
    ``TorchFunctionMode`` is consulted."""

    def empty_like(t, *args, device=None, pin_memory=False, **kwargs):
        if t.device.type == DEVICE and device is not None and torch.device(device).type == "cpu":
            with rec.on_host():
                return real(t, *args, device=DEVICE, **kwargs)
        return real(t, *args, device=device, pin_memory=pin_memory, **kwargs)

    return empty_like


def _host_moves(rec, real_to):
    """``Tensor.to`` where a host copy comes back to the GPU (``.to("cuda")`` of a tensor the
    recorder counts as the host's): a new GPU tensor, which ``.to`` of meta onto meta would not
    make; other moves onto "cuda" of a meta tensor stay where they are, as a CUDA tensor's do.
    Patched on the class: the unpack hook runs inside the autograd engine."""

    def to(t, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if t.device.type == DEVICE and standin._is_cuda(target):
            if t.untyped_storage()._cdata in rec.untracked:
                return torch.empty_like(t, device=DEVICE).copy_(t)
            return t
        return real_to(t, *args, **kwargs)

    return to
