"""gpumem_trace: record what a PyTorch training step does to GPU memory, without a GPU.

The model runs for real — forward, loss, backward, ``optimizer.step()``, ``zero_grad()`` — on
``meta`` tensors standing in for CUDA ones. A ``TorchDispatchMode`` sees every ATen op after
autograd, records each new storage (size, category, phase, op) and, through a weak reference to
the storage, the moment it dies. Where CPU dispatch would differ from CUDA's (fused dropout,
scaled-dot-product attention kernels, autocast op lists, cuBLAS workspaces), the tracer applies
CUDA's behaviour. All modelling of the allocator lives in gpumem (Rust); this package only records.

Principal pieces: ``tracer.Recorder`` (events), ``tracer.TraceMode`` (the dispatch mode),
``cuda.patches`` (CUDA behaviour on meta tensors), ``amp.Autocast`` (CUDA autocast lists),
``models.resolve`` (model references), ``loop.trace_training`` (the training loop).
"""

__version__ = "0.1.0"


def __getattr__(name):
    # The loop (and torch) load when first asked for: the tracer's entry points import torch
    # themselves, with the cyclic collector paused (``__main__.preload``).
    if name in ("TraceOptions", "trace_training"):
        from . import loop

        return getattr(loop, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
