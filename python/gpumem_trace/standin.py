"""A stand-in CUDA for library code: transformers, accelerate, PEFT and the Hugging Face Trainer
ask ``torch.cuda`` whether there is a GPU and put their tensors "on cuda"; inside
``cuda(gpu, recorder)`` they run unmodified and what they put on the GPU is made on the
tracer's meta device, where the ``TraceMode`` records it.

- ``torch.cuda``'s queries (and ``torch.accelerator``'s) answer as ``gpu`` would: available,
  its name, capability and memory; ``memory_allocated``/``max_memory_allocated`` from the
  recorder's live tensors; ``empty_cache`` becomes the trace's ``empty_cache`` event;
  ``synchronize``, ``set_device`` and the like do nothing.
- ``device="cuda"`` (any index) in a factory call, ``.to("cuda")``, ``.cuda()`` and
  ``Module.to("cuda")`` make meta tensors; a module keeps its tied weights tied, as a real
  CPU→CUDA move does.
- What leaves the GPU for the host (``.cpu()``) stays a meta tensor the recorder counts as the
  host's; ``.numpy()``/``.tolist()`` of one give zeros of its shape. Those are placeholders: no
  value computed on the stand-in is real, so only library code whose memory does not depend on
  values may run here (evaluation loops, loading, saving), never a user's branch on a value.
- Checks that library code caches (transformers' ``is_torch_cuda_available``, accelerate's
  process state) are cleared on the way in and out, so they ask the stand-in and forget it.
- bitsandbytes quantizes a ``Params4bit`` moved onto the stand-in, as it does on a GPU.
"""

import contextlib
import functools
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from .device import DEVICE, to_device_keeping_ties
from .tracer import storage_key


@dataclass(frozen=True)
class StandinGpu:
    """What the stand-in says about the GPU: as ``torch.cuda.get_device_properties`` would."""

    name: str = "NVIDIA H100 80GB HBM3"
    total_memory: int = 80 * 2**30
    capability: tuple = (9, 0)
    count: int = 1
    multi_processor_count: int = 132

    @staticmethod
    def with_capability(capability):
        """The stand-in for a GPU known by its compute capability ("8.0") alone."""
        major, minor = (int(x) for x in str(capability).split("."))
        return StandinGpu(capability=(major, minor))


def _is_cuda(device):
    """A CUDA device as PyTorch takes one: a device, its name, or its index."""
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


def _is_meta(device):
    return (isinstance(device, torch.device) and device.type == DEVICE) or device == DEVICE


def _on_meta(x):
    return DEVICE if _is_cuda(x) else x


class _CudaOnMeta(TorchFunctionMode):
    """Calls that name a CUDA device make their tensors on meta instead; calls that name the
    meta device themselves (a model's skeleton, accelerate's offloaded weights) make tensors
    that hold no memory, which the recorder leaves out."""

    def __init__(self, rec, once_bitsandbytes_loads):
        super().__init__()
        self.rec = rec
        self.meta_is_gpu = False
        # Called once bitsandbytes is imported (transformers imports it for a 4-bit load, inside
        # the stand-in): not imported here for every evaluation, which takes seconds.
        self.once_bitsandbytes_loads = once_bitsandbytes_loads

    @contextlib.contextmanager
    def meta_is_the_gpu(self):
        """Inside, library code that names meta means the GPU: it makes tensors on the device
        of a tensor that is on the stand-in (``device=weight.device``)."""
        saved, self.meta_is_gpu = self.meta_is_gpu, True
        try:
            yield
        finally:
            self.meta_is_gpu = saved

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.once_bitsandbytes_loads is not None and "bitsandbytes.nn" in sys.modules:
            loaded, self.once_bitsandbytes_loads = self.once_bitsandbytes_loads, None
            loaded()
        if not self.meta_is_gpu and (
            _is_meta(kwargs.get("device"))
            or (func is torch.Tensor.to and any(_is_meta(a) for a in args[1:]))
        ):
            with self.rec.storageless():
                return func(*args, **kwargs)
        if func is torch.Tensor.cuda:
            return args[0].to(DEVICE, **{k: v for k, v in kwargs.items() if k != "device"})
        if func is torch.Tensor.pin_memory:
            return args[0]  # page-locking is a host matter; a CPU-only torch cannot
        if func is torch.Tensor.numpy and args[0].device.type == DEVICE:
            return _zeros(args[0])
        if func is torch.Tensor.tolist and args[0].device.type == DEVICE:
            return _zeros(args[0]).tolist()
        if "device" in kwargs:
            kwargs["device"] = _on_meta(kwargs["device"])
        if func is torch.Tensor.to:
            args = tuple(_on_meta(a) for a in args)
        return func(*args, **kwargs)


def _zeros(t):
    """A placeholder for a meta tensor's values on the host: zeros of its shape and dtype,
    broadcast from one element (no host memory of its size)."""
    dtype = torch.float32 if t.dtype == torch.bfloat16 else t.dtype
    return np.broadcast_to(torch.zeros((), dtype=dtype).numpy(), tuple(t.shape))


def _live_bytes(rec):
    return sum(rec.events[i]["bytes"] for _, i in rec.live.values())


class _Stats:
    """torch.cuda's memory statistics, as far as the trace knows them: what is allocated now
    and its peak since the last reset (the caching allocator's reserve is gpumem's replay)."""

    def __init__(self, rec):
        self.rec, self.peak = rec, 0

    def allocated(self, device=None):
        now = _live_bytes(self.rec)
        self.peak = max(self.peak, now)
        return now

    def max_allocated(self, device=None):
        return max(self.peak, self.allocated())

    def reset_peak(self, device=None):
        self.peak = 0


def _caches_cleared():
    """Forget the answers library code cached about the GPU: transformers' lru-cached
    ``is_torch_*_available`` checks and accelerate's process state."""
    utils = sys.modules.get("transformers.utils.import_utils")
    if utils is not None:
        for name in dir(utils):
            f = getattr(utils, name)
            if name.startswith("is_") and callable(getattr(f, "cache_clear", None)):
                f.cache_clear()
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)


@contextlib.contextmanager
def patched(target, **attrs):
    """``target``'s attributes set to ``attrs`` inside, as they were after: its own put back
    as they were stored (a ``staticmethod`` stays one), an inherited one by deleting the
    override."""
    saved = {k: vars(target)[k] for k in attrs if k in vars(target)}
    for k, v in attrs.items():
        setattr(target, k, v)
    try:
        yield
    finally:
        for k in attrs:
            if k in saved:
                setattr(target, k, saved[k])
            else:
                delattr(target, k)


def _accelerate_moves():
    """accelerate's ``set_module_tensor_to_device`` takes a meta tensor for one with no value
    yet; here meta is the stand-in GPU, and a tensor already on it moved to it again stays,
    as on a GPU. Patched where accelerate's modules hold the function."""
    modeling = sys.modules.get("accelerate.utils.modeling")
    if modeling is None:
        return contextlib.nullcontext()
    real = modeling.set_module_tensor_to_device

    @functools.wraps(real)
    def move(module, tensor_name, device, value=None, *args, **kwargs):
        if value is None and _is_cuda(device):
            module_, name = module, tensor_name
            for part in tensor_name.split(".")[:-1]:
                module_ = getattr(module_, part)
            name = tensor_name.split(".")[-1]
            held = module_._parameters.get(name, module_._buffers.get(name))
            if held is not None and held.device.type == DEVICE:
                return None
        return real(module, tensor_name, device, value, *args, **kwargs)

    stack = contextlib.ExitStack()
    for mod in list(sys.modules.values()):
        if (getattr(mod, "__name__", "") or "").startswith("accelerate") and getattr(
            mod, "set_module_tensor_to_device", None
        ) is real:
            stack.enter_context(patched(mod, set_module_tensor_to_device=move))
    return stack


@contextlib.contextmanager
def _bitsandbytes_quantizes(rec, mode):
    """bitsandbytes quantizes a ``Params4bit`` when it is moved to a device other than meta —
    transformers' 4-bit loader hands it each weight with ``.to(weight.device)``. On the stand-in
    the GPU is meta: a ``Params4bit`` moved there that holds the GPU's memory (not a skeleton's)
    is quantized there, by bitsandbytes' own ``_quantize`` and its ops' meta kernels. Inside it,
    meta is the GPU (bitsandbytes makes its codebooks on the weight's device); the codebook it
    caches for the process is forgotten on the way out, as the stand-in's GPU is."""
    try:
        import bitsandbytes.functional as functional
        from bitsandbytes.nn import Params4bit
    except Exception:  # an install that cannot load: library code will say so itself
        yield
        return
    real = Params4bit.to

    @functools.wraps(real)
    def to(self, *args, **kwargs):
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if (
            device is not None
            and device.type == DEVICE
            and not self.bnb_quantized
            and storage_key(self) in rec.live
        ):
            with mode.meta_is_the_gpu():
                return self._quantize(device)
        return real(self, *args, **kwargs)

    cached = dict(functional.name2qmap)
    try:
        with patched(Params4bit, to=to):
            yield
    finally:
        functional.name2qmap.clear()
        functional.name2qmap.update(cached)


@contextlib.contextmanager
def _environ(**values):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _module_to(real):
    """``Module.to`` / ``Module.cuda``: onto the stand-in GPU as a real move is (tied weights
    stay tied; what is already there stays as it is); elsewhere as PyTorch does it."""

    @functools.wraps(real)
    def to(self, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is None or not _is_cuda(device):
            return real(self, *args, **kwargs)
        if dtype is not None:
            real(self, dtype)  # the cast first, where it is, then the move
        to_device_keeping_ties(self, only=lambda t: t.device.type != DEVICE, device="cuda")
        return self

    return to


def _cuda_queries(gpu, rec, stats):
    """``torch.cuda``'s queries as ``gpu`` answers them, over the recorder's live tensors."""
    props = type(
        "_CudaDeviceProperties",
        (),
        {
            "name": gpu.name,
            "total_memory": gpu.total_memory,
            "major": gpu.capability[0],
            "minor": gpu.capability[1],
            "multi_processor_count": gpu.multi_processor_count,
            "is_integrated": False,
            "__repr__": lambda self: f"_CudaDeviceProperties(name='{gpu.name}')",
        },
    )()
    nothing = lambda *a, **k: None

    def free_and_total(device=None):
        return gpu.total_memory - stats.allocated(), gpu.total_memory

    cuda_queries = dict(
        is_available=lambda: True,
        is_initialized=lambda: True,
        device_count=lambda: gpu.count,
        current_device=lambda: 0,
        set_device=nothing,
        # `with torch.cuda.device(i):` (a kernel library choosing where to launch): one GPU.
        device=lambda device=None: contextlib.nullcontext(),
        synchronize=nothing,
        init=nothing,
        get_device_name=lambda device=None: gpu.name,
        get_device_capability=lambda device=None: gpu.capability,
        get_device_properties=lambda device=None: props,
        is_bf16_supported=lambda including_emulation=True: gpu.capability >= (8, 0),
        mem_get_info=free_and_total,
        memory_allocated=stats.allocated,
        max_memory_allocated=stats.max_allocated,
        memory_reserved=stats.allocated,
        max_memory_reserved=stats.max_allocated,
        reset_peak_memory_stats=stats.reset_peak,
        reset_max_memory_allocated=stats.reset_peak,
        empty_cache=rec.empty_cache,
        manual_seed=nothing,
        manual_seed_all=nothing,
        # torch.optim's step asks before it runs (a captured step takes other paths).
        is_current_stream_capturing=lambda: False,
    )
    return cuda_queries


@contextlib.contextmanager
def device_calls(gpu: StandinGpu, rec):
    """The narrow stand-in, for a kernel library's Python inside a traced step: ``torch.cuda``'s
    queries answer as ``gpu`` would and calls naming a CUDA device make (recorded) meta tensors;
    nothing else is stood in for."""
    with patched(torch.cuda, **_cuda_queries(gpu, rec, _Stats(rec))), _CudaOnMeta(rec, None):
        yield


@contextlib.contextmanager
def cuda(gpu: StandinGpu, rec):
    """Library code inside sees ``gpu`` and allocates on the recorder's meta device (the
    caller's ``TraceMode`` must be active to record it)."""
    # torch._dynamo maps torch's functions to its rules by identity when it is imported (as
    # PyTorch's own Python references do on first use): before they are stood in for.
    import torch._dynamo  # noqa: F401

    stats = _Stats(rec)
    cuda_queries = _cuda_queries(gpu, rec, stats)
    accelerator = getattr(torch, "accelerator", None)
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(torch.cuda, **cuda_queries))
        stack.enter_context(
            patched(
                torch.cuda.memory,
                **{
                    k: cuda_queries[k]
                    for k in (
                        "mem_get_info",
                        "memory_allocated",
                        "max_memory_allocated",
                        "memory_reserved",
                        "max_memory_reserved",
                        "empty_cache",
                        "reset_peak_memory_stats",
                    )
                    if hasattr(torch.cuda.memory, k)
                },
            )
        )
        if accelerator is not None:
            stack.enter_context(
                patched(
                    accelerator,
                    is_available=lambda: True,
                    current_accelerator=lambda check_available=False: torch.device("cuda"),
                    device_count=lambda: gpu.count,
                    current_device_index=lambda: 0,
                    synchronize=cuda_queries["synchronize"],
                    set_device_index=cuda_queries["set_device"],
                )
            )
        stack.enter_context(
            patched(
                torch.nn.Module,
                to=_module_to(torch.nn.Module.to),
                cuda=lambda self, device=None: self.to("cuda"),
            )
        )
        # PyTorch's modes are the calling thread's: transformers' threaded loading (from 5.0)
        # would put its tensors on a CUDA the worker threads do not see stood in.
        stack.enter_context(_environ(HF_DEACTIVATE_ASYNC_LOAD="1"))
        stack.enter_context(_accelerate_moves())
        on_meta = _CudaOnMeta(
            rec, lambda: stack.enter_context(_bitsandbytes_quantizes(rec, on_meta))
        )
        _caches_cleared()
        stack.callback(_caches_cleared)
        stack.enter_context(on_meta)
        yield stats
