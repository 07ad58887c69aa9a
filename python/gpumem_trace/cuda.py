"""CUDA behaviour on meta tensors, where CPU/meta dispatch would choose differently.

- Dropout: CUDA runs the fused ``native_dropout`` (output + a 1-byte mask); the CPU path would
  keep a noise tensor of the input's dtype.
- Scaled dot-product attention: CUDA picks a kernel by torch release, GPU and inputs
  (sdpa.py), each with its own saved tensors and buffers.
- Triton kernels (torchtitan's MoE index fill) write into tensors their callers allocated:
  launched on meta tensors, they do nothing.
"""

import contextlib
import sys
import types

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function

from . import sdpa as attention

aten = torch.ops.aten
_orig_dropout = F.dropout
_orig_sdpa = F.scaled_dot_product_attention


def _dropout(input, p=0.5, training=True, inplace=False):
    if training and not inplace and 0.0 < p < 1.0 and input.numel() > 0:
        return aten.native_dropout(input, p, True)[0]
    return _orig_dropout(input, p, training, inplace)


def make_sdpa(stack):
    """``F.scaled_dot_product_attention`` as the target GPU runs it (see sdpa.py)."""

    def sdpa(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ):
        if has_torch_function((query, key, value)):
            # An active TorchFunctionMode (the emulated autocast: SDPA is on CUDA's
            # lower-precision list) sees the call first, as it would torch's own function.
            return handle_torch_function(
                sdpa,
                (query, key, value),
                query,
                key,
                value,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        dtensor = _dtensor_type()
        if dtensor is not None and isinstance(query, dtensor) and _heads_only(query):
            # Tensor parallelism's heads (torchtitan's plans keep them DTensors through a
            # per-head norm): each rank attends over its own, as DTensor's own SDPA strategy
            # runs it, in the kernel on the rank's local tensors. (Context parallelism's,
            # sharded over the sequence, go to the kernel as DTensors: its ring attention
            # answers for them there.)
            local = lambda t: t.to_local() if isinstance(t, dtensor) else t
            out = sdpa(
                *map(local, (query, key, value, attn_mask)),
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
            return dtensor.from_local(out, query.device_mesh, query.placements, run_check=False)
        return attention.run(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, stack, _orig_sdpa
        )

    sdpa.autocast_low = True
    return sdpa


def _heads_only(t):
    """Whether DTensor ``t`` (batch, heads, sequence, head dim) is split over its heads alone."""
    return all(not p.is_shard() or p.dim == 1 for p in t.placements)


def _dtensor_type():
    """PyTorch's DTensor where this torch has one and a job brought it in, else None."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


_meta_lib = None


def register_meta_kernels():
    """Ops with a CUDA kernel but no Meta kernel would run their math decomposition on meta
    tensors (allocating intermediates CUDA never allocates, and saving different tensors for
    backward). Give them a Meta kernel that runs the decomposition out of the tracer's sight, so
    the trace shows one kernel with its outputs, as on CUDA."""
    global _meta_lib
    if _meta_lib is not None:
        return
    has = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    if has is None or not hasattr(torch._C, "_dispatch_get_all_op_names"):
        return  # a torch without the dispatcher's introspection: its math decompositions run
    _meta_lib = torch.library.Library("aten", "IMPL")
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::") or not (
            has(name, "CUDA") and has(name, "CompositeImplicitAutograd") and not has(name, "Meta")
        ):
            continue
        base, _, overload = name[len("aten::") :].partition(".")
        op = getattr(getattr(torch.ops.aten, base), overload or "default")
        # Library.impl refuses Meta kernels for such ops (core wants decompositions there);
        # the C++ registration underneath does exactly what we need.
        _meta_lib.m.impl(
            name[len("aten::") :], "Meta", lambda *a, _op=op, **k: _op.decompose(*a, **k), False
        )
    for name, kernel in attention.MISSING_META.items():
        if not has(f"aten::{name}", "Meta"):
            _meta_lib.impl(name, kernel, "Meta")
    # addmm with an fp32 result from 16-bit operands (Liger's in-place accumulation of the
    # head's gradient): torch's meta kernel runs addmm's decomposition, which takes the dtype
    # for `beta` and fails. Its output is `out`, or one of the product's shape in that dtype.
    if hasattr(torch.ops.aten.addmm, "dtype_out"):
        _meta_lib.m.impl("addmm.dtype_out", "Meta", _addmm_dtype_out, False)
        _meta_lib.m.impl("addmm.dtype", "Meta", _addmm_dtype, False)


def _addmm_dtype_out(self, mat1, mat2, out_dtype, beta=1, alpha=1, *, out):
    return out


def _addmm_dtype(self, mat1, mat2, out_dtype, beta=1, alpha=1):
    return torch.empty((mat1.shape[0], mat2.shape[1]), dtype=out_dtype, device=self.device)


@contextlib.contextmanager
def patches(stack):
    """Installs CUDA behaviour for the duration of a trace; ``stack`` is the target's
    ``sdpa.Stack``."""
    register_meta_kernels()
    saved = (F.dropout, F.scaled_dot_product_attention)
    F.dropout = _dropout
    F.scaled_dot_product_attention = make_sdpa(stack)
    # torch.utils.checkpoint looks up a device module for the tensors' device to stash its RNG
    # state; before 2.5 there is none for meta. A meta "device" that was never initialised has
    # no RNG state to stash, as checkpoint then concludes.
    shim = not hasattr(torch, "meta")
    if shim:
        torch.meta = types.SimpleNamespace(_initialized=False, device_count=lambda: 0)
    # Only where the job's code brought triton in: importing it costs a trace seconds.
    jit = sys.modules.get("triton.runtime.jit")
    launch = jit.JITFunction.run if jit else None
    if jit:

        def run(self, *args, **kwargs):
            # Tensors go in by position or by name (Liger's launches name theirs).
            if any(
                isinstance(a, torch.Tensor) and a.device.type == "meta"
                for a in (*args, *kwargs.values())
            ):
                return None
            return launch(self, *args, **kwargs)

        jit.JITFunction.run = run
    try:
        yield
    finally:
        F.dropout, F.scaled_dot_product_attention = saved
        if shim:
            del torch.meta
        if jit:
            jit.JITFunction.run = launch
