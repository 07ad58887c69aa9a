"""CUDA behaviour on meta tensors, where CPU/meta dispatch would choose differently.

- Dropout: CUDA runs the fused ``native_dropout`` (output + a 1-byte mask); the CPU path would
  keep a noise tensor of the input's dtype.
- Scaled dot-product attention: CUDA picks the flash or memory-efficient kernel by GPU and
  dtype; the profile says which kernels the GPU has (``sdpa``), and this picks as PyTorch does.
"""

import contextlib

import torch
import torch.nn.functional as F

aten = torch.ops.aten
_orig_dropout = F.dropout
_orig_sdpa = F.scaled_dot_product_attention


def _dropout(input, p=0.5, training=True, inplace=False):
    if training and not inplace and 0.0 < p < 1.0 and input.numel() > 0:
        return aten.native_dropout(input, p, True)[0]
    return _orig_dropout(input, p, training, inplace)


def sdpa_backend(q, k, v, attn_mask, capability, enable_gqa=False):
    """The kernel PyTorch's CUDA dispatcher would choose (flash > mem-efficient > math)."""
    low = q.dtype in (torch.float16, torch.bfloat16)
    same = q.dtype == k.dtype == v.dtype
    d = q.shape[-1]
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        return "math"
    if capability == "flash" and low and same and attn_mask is None and d <= 256 and d % 8 == 0 and q.dim() == 4:
        return "flash"
    if capability in ("flash", "mem_efficient") and same and q.dim() == 4 and d % (8 if low else 4) == 0:
        return "mem_efficient"
    return "math"


def make_sdpa(capability):
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        backend = sdpa_backend(query, key, value, attn_mask, capability, enable_gqa)
        if backend == "flash":
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        if backend == "mem_efficient":
            bias = attn_mask
            if bias is not None and bias.dtype == torch.bool:
                bias = torch.zeros_like(bias, dtype=query.dtype).masked_fill_(bias.logical_not(), float("-inf"))
            grad = query.requires_grad or key.requires_grad or value.requires_grad
            return aten._scaled_dot_product_efficient_attention(query, key, value, bias, grad, dropout_p, is_causal, scale=scale)[0]
        kw = {"enable_gqa": enable_gqa} if enable_gqa else {}
        return _orig_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)

    return sdpa


_meta_lib = None


def register_meta_kernels():
    """Ops with a CUDA kernel but no Meta kernel would run their math decomposition on meta
    tensors (allocating intermediates CUDA never allocates, and saving different tensors for
    backward). Give them a Meta kernel that runs the decomposition out of the tracer's sight, so
    the trace shows one kernel with its outputs, as on CUDA."""
    global _meta_lib
    if _meta_lib is not None:
        return
    _meta_lib = torch.library.Library("aten", "IMPL")
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::") or not (has(name, "CUDA") and has(name, "CompositeImplicitAutograd") and not has(name, "Meta")):
            continue
        base, _, overload = name[len("aten::"):].partition(".")
        op = getattr(getattr(torch.ops.aten, base), overload or "default")
        # Library.impl refuses Meta kernels for such ops (core wants decompositions there);
        # the C++ registration underneath does exactly what we need.
        _meta_lib.m.impl(name[len("aten::"):], "Meta", lambda *a, _op=op, **k: _op.decompose(*a, **k), False)


@contextlib.contextmanager
def patches(sdpa_capability):
    """Installs CUDA behaviour for the duration of a trace."""
    register_meta_kernels()
    saved = (F.dropout, F.scaled_dot_product_attention)
    F.dropout = _dropout
    F.scaled_dot_product_attention = make_sdpa(sdpa_capability)
    try:
        yield
    finally:
        F.dropout, F.scaled_dot_product_attention = saved
