"""Scaled dot-product attention as PyTorch's CUDA dispatch runs it, emulated on meta tensors.

``F.scaled_dot_product_attention`` on a GPU walks a priority order of kernels (flash,
memory-efficient, cuDNN, math) and runs the first whose checks pass; each kernel saves and
allocates different tensors. The order and the checks depend on the torch release, the GPU's
compute capability and the cuDNN library torch loads, so the tracer decides with the installed
torch's rules and the target GPU's capability. Sources (per release, see docs/sdpa.md):
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (``priority_order``,
``can_use_{flash,mem_efficient,cudnn}_attention``), sdp_utils_cpp.h (the shared checks),
attention.cpp (mask conversion and padding before each kernel), and the kernels' backward
functions for their temporary buffers.
"""

import os
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

aten = torch.ops.aten

FLASH, EFFICIENT, CUDNN, MATH = "flash", "efficient", "cudnn", "math"
BACKENDS = (FLASH, EFFICIENT, CUDNN, MATH)
# at::SDPBackend's values, as torch._C._get_sdp_priority_order() reports them.
_ENUM = {0: MATH, 1: FLASH, 2: EFFICIENT, 3: CUDNN}
_HALF = (torch.float16, torch.bfloat16)


def _version(text):
    """(major, minor, patch) of a version string such as ``2.11.0+cu130``."""
    parts = [int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3]]
    return tuple(parts + [0] * (3 - len(parts)))


def _env_true(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _env_false(name):
    return os.environ.get(name, "").strip().lower() in ("0", "false", "no", "off")


@dataclass(frozen=True)
class Stack:
    """What the choice depends on: torch's release, the target GPU, the cuDNN torch loads."""

    torch: tuple
    capability: tuple  # (major, minor) of the target GPU
    cudnn_runtime: int  # e.g. 91900 for cuDNN 9.19; 0 if torch has none
    cudnn_compiled: int
    cuda_major: int
    forced: str = None  # a backend the user forced (a profile's `sdpa`), else None
    enabled: frozenset = frozenset(BACKENDS)  # torch.backends.cuda.enable_*_sdp switches
    context_order: tuple = None  # the context's priority order (2.6+), as torch reports it
    required: bool = False  # the forced backend or nothing (FlashAttention-2 has no fallback)

    @classmethod
    def here(cls, capability, forced=None, required=False):
        """The installed torch, targeting a GPU of ``capability`` ("9.0")."""
        try:
            runtime = torch.backends.cudnn.version() or 0
        except Exception:  # no cuDNN library in this torch build
            runtime = 0
        try:
            major, minor, patch = torch._C._cudnn.getCompileVersion()
            compiled = major * 10000 + minor * 100 + patch
        except Exception:
            compiled = runtime
        cap = tuple(int(x) for x in (capability or "8.0").split(".")[:2])
        switches = {
            FLASH: "flash_sdp_enabled",
            EFFICIENT: "mem_efficient_sdp_enabled",
            CUDNN: "cudnn_sdp_enabled",
            MATH: "math_sdp_enabled",
        }
        # cuDNN's switch reads off in 2.4, where its kernel is opt-in by an environment variable.
        enabled = frozenset(
            b for b, f in switches.items() if getattr(torch.backends.cuda, f, lambda: True)()
        )
        order = (
            tuple(_ENUM[i] for i in torch._C._get_sdp_priority_order() if i in _ENUM)
            if hasattr(torch._C, "_get_sdp_priority_order")
            else None
        )
        return cls(
            _version(torch.__version__),
            cap,
            runtime,
            compiled,
            _version(torch.version.cuda or "12")[0],
            forced,
            enabled,
            order,
            required,
        )

    def at_least(self, *v):
        return self.torch[: len(v)] >= v

    def order(self):
        """``priority_order()`` in sdp_utils.cpp."""
        order = list(self.context_order or (FLASH, EFFICIENT, MATH, CUDNN))
        if self.prefers_cudnn():
            order = [CUDNN] + [b for b in order if b != CUDNN]
        elif self.torch[:2] == (2, 4):
            order = [CUDNN, FLASH, EFFICIENT, MATH]  # cuDNN first, but only eligible when opted in
        elif self.torch[:3] == (2, 5, 0):
            order = [FLASH, CUDNN, EFFICIENT, MATH]
        return order

    def prefers_cudnn(self):
        major, minor = self.capability
        if self.torch[:3] == (2, 5, 0):
            return major >= 9
        if self.torch[:2] == (2, 9):
            # Decided at compile time against the cuDNN the wheel was built with (9.8 on PyPI).
            return (
                not _env_false("TORCH_CUDNN_SDPA_PREFERRED")
                and self.cudnn_compiled >= 90900
                and major in (9, 10)
                and minor == 0
            )
        if self.at_least(2, 10):
            if (
                _env_true("TORCH_CUDNN_SDPA_DEPRIORITIZED")
                or self.cudnn_runtime <= 91500
                or major not in (9, 10)
            ):
                return False
            # From 2.14, CUDA 13 builds prefer it on every sm9x/sm10x part.
            return minor in (0, 3) or (self.at_least(2, 14) and self.cuda_major >= 13)
        return False

    def max_capability(self):
        """Newest architecture the fused kernels are built for."""
        return (
            (9, 0) if not self.at_least(2, 7) else (12, 0) if self.torch[:2] == (2, 7) else (12, 1)
        )


@dataclass
class Call:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor
    dropout: float
    causal: bool
    gqa: bool

    @property
    def grad(self):
        return torch.is_grad_enabled() and any(t.requires_grad for t in (self.q, self.k, self.v))

    def heads_ok(self, s, gqa_since, mqa_since=(2, 14), same_kv_heads=True):
        """``check_batch_size_and_num_heads_dense``: equal heads, or grouped-query attention where
        the kernel has it."""
        q, k, v = self.q, self.k, self.v
        if not (q.shape[0] == k.shape[0] == v.shape[0]):
            return False
        hq, hk, hv = q.shape[1], k.shape[1], v.shape[1]
        if hq == hk == hv:
            return True
        if s.at_least(*mqa_since) and hk == hv == 1:
            return True
        if gqa_since and self.gqa and s.at_least(*gqa_since):
            return hq % hk == 0 and hq % hv == 0 and (hk == hv or not same_kv_heads)
        return False

    def dense(self, ignore_singleton):
        """4-D inputs, non-empty sequences, last dimension contiguous (mask included)."""
        ts = (self.q, self.k, self.v)
        if any(t.dim() != 4 for t in ts) or self.q.shape[2] == 0 or self.k.shape[2] == 0:
            return False
        for t in ts + ((self.mask,) if self.mask is not None else ()):
            if t.dim() and t.stride(-1) != 1 and not (ignore_singleton and t.shape[-1] == 1):
                return False
        return True


def _in_range(cap, low, high):
    return low <= cap <= high


def can_flash(c, s):
    q, k, v = c.q, c.k, c.v
    cap = s.capability
    d = q.shape[-1]
    if FLASH not in s.enabled or c.mask is not None or not c.dense(True):
        return False
    if (
        not _in_range(cap, (8, 0), s.max_capability())
        or q.dtype not in _HALF
        or not (q.dtype == k.dtype == v.dtype)
    ):
        return False
    if not (d == k.shape[-1] == v.shape[-1] and d <= 256):
        return False
    if c.causal and q.shape[2] != k.shape[2]:
        return False
    big_head_archs = (
        [(8, 6), (8, 9)]
        + ([(12, 0)] if s.at_least(2, 7) else [])
        + ([(12, 1)] if s.at_least(2, 8) else [])
    )
    if c.grad and cap in big_head_archs and (192 < d <= 224 or (d > 224 and c.dropout > 0)):
        return False
    if s.at_least(2, 15) and max(q.shape[0], q.shape[1]) > 65535:
        return False
    return c.heads_ok(s, gqa_since=(2, 5))


def can_efficient(c, s):
    q, k, v = c.q, c.k, c.v
    cap = s.capability
    if EFFICIENT not in s.enabled or not c.dense(False):
        return False
    if not _in_range(cap, (5, 0), s.max_capability()) or not (q.dtype == k.dtype == v.dtype):
        return False
    if q.dtype not in (
        (torch.float16, torch.float32, torch.bfloat16)
        if cap >= (8, 0)
        else (torch.float16, torch.float32)
    ):
        return False
    half = q.dtype in _HALF
    align = (8 if half else 4) if cap >= (8, 0) else (8 if half else 1) if cap >= (7, 0) else 1
    if q.shape[-1] != k.shape[-1] or q.shape[-1] % align or v.shape[-1] % align:
        return False
    if s.at_least(2, 13) and cap >= (8, 0) and any(t.storage_offset() % align for t in (q, k, v)):
        return False
    return c.heads_ok(s, gqa_since=(2, 14))


def can_cudnn(c, s):
    q, k, v = c.q, c.k, c.v
    cap, cudnn = s.capability, s.cudnn_runtime
    if not s.at_least(2, 5):
        # 2.4 runs it only when opted in (TORCH_CUDNN_SDPA_ENABLED), without gradients, on a
        # packed-QKV layout: never for a training step.
        return False
    if CUDNN not in s.enabled or s.cudnn_compiled < 90000:
        return False
    if (
        not _in_range(cap, (8, 0), s.max_capability())
        or q.dtype not in _HALF
        or not (q.dtype == k.dtype == v.dtype)
    ):
        return False
    if (
        torch.are_deterministic_algorithms_enabled()
        and not torch.is_deterministic_algorithms_warn_only_enabled()
    ):
        return False
    m = c.mask
    if m is not None:
        if (
            m.requires_grad
            or m.dim() not in (2, 4)
            or m.shape[-2] not in (1, q.shape[2])
            or m.shape[-1] not in (1, k.shape[2])
        ):
            return False
        if m.dim() == 4 and (
            m.shape[0] not in (1, q.shape[0]) or m.shape[1] not in (1, q.shape[1])
        ):
            return False
    if not c.dense(True) or not c.heads_ok(s, gqa_since=(2, 8), same_kv_heads=False):
        return False
    dqk, dv = q.shape[-1], v.shape[-1]
    if dqk % 8 or dv % 8:
        return False
    sm90 = cap == (9, 0)
    sm10x = cap[0] == 10
    if s.at_least(2, 14):
        limit = (
            256
            if (sm90 or (sm10x and not (cap == (10, 7) and cudnn <= 92500))) and cudnn > 92200
            else 128
        )
        if max(dqk, dv) > limit and not (
            (sm90 or sm10x) and cudnn >= 91100 and (dqk, dv) == (192, 128)
        ):
            return False
        if (
            limit == 256
            and c.grad
            and not (max(dqk, dv) <= 128 or (dqk, dv) in ((192, 128), (256, 256)))
        ):
            return False
    elif s.at_least(2, 9):
        limit = 256 if cudnn >= 91000 and sm90 else 128
        if max(dqk, dv) > limit and not (
            sm10x and cudnn >= 91100 and (dqk, dv) == (192, 128) and s.at_least(2, 10)
        ):
            return False
    elif max(dqk, dv) > 128:
        return False
    L, S = q.shape[2], k.shape[2]
    if s.at_least(2, 9):
        if S == 1 or (L == 1 and c.dropout > 0):
            return False
        if c.dropout > 0 and 91100 < cudnn < 91400:
            return False
    elif s.at_least(2, 6) and (L == 1 or S == 1):
        return False
    if s.at_least(2, 12) and c.dropout > 0 and abs(c.dropout * 16 - round(c.dropout * 16)) > 1e-9:
        return False
    if s.at_least(2, 13) and max(q.shape[0], q.shape[1]) > 65535:
        return False
    return True


CHECKS = {FLASH: can_flash, EFFICIENT: can_efficient, CUDNN: can_cudnn}


def choose(c, s):
    """``select_sdp_backend``: the first kernel in priority order whose checks pass."""
    order = [s.forced] if s.forced else s.order()
    if s.required and s.forced != MATH and not CHECKS[s.forced](c, s):
        from .models import ReferenceError_  # models imports nothing of the tracer's

        raise ReferenceError_(
            f"{s.forced} attention cannot run this call: it needs fp16 or bf16 inputs on an "
            f"Ampere or newer GPU (this one is sm{s.capability[0]}{s.capability[1]}), no attention "
            "mask and a head dimension of at most 256 (try --attention sdpa or eager)"
        )
    for backend in order:
        if backend == MATH:
            if MATH in s.enabled:
                return MATH
        elif CHECKS[backend](c, s):
            return backend
    return MATH


def _as_bias(mask, dtype):
    """``convert_boolean_attn_mask``: a boolean mask becomes an additive one of the query's dtype
    and of the mask's own shape; a float mask is used as it is."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(
        mask.logical_not(),
        torch.tensor(float("-inf"), dtype=dtype, device=mask.device),
        torch.tensor(0.0, dtype=dtype, device=mask.device),
    )


def _aligned(t, alignment=8):
    return t.stride(-1) == 1 and all(st % alignment == 0 for st in t.stride()[:-1])


def run(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, stack, fallback):
    """Runs the chosen kernel the way attention.cpp calls it; ``fallback`` is torch's own
    function, whose composite is the math kernel on meta tensors."""
    c = Call(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    backend = choose(c, stack)
    if backend == FLASH:
        d = query.shape[-1]
        pad = (-d) % 8  # the kernel needs a head dimension that is a multiple of 8: copies padded
        q, k, v = (F.pad(t, (0, pad)) if pad else t for t in (query, key, value))
        scale = scale if scale is not None else d**-0.5
        out = aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p, is_causal, False, scale=scale
        )[0]
        return out[..., :d] if pad else out
    if backend == EFFICIENT:
        bias = _as_bias(attn_mask, query.dtype)
        if bias is not None:
            if not _aligned(bias):
                s = bias.shape[-1]
                bias = F.pad(bias, (0, 8 - s % 8))[..., :s]
            bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, c.grad, dropout_p, is_causal, scale=scale
        )[0]
    if backend == CUDNN:
        bias = _as_bias(attn_mask, query.dtype)
        return aten._scaled_dot_product_cudnn_attention(
            query, key, value, bias, c.grad, dropout_p, is_causal, False, scale=scale
        )[0]
    kw = {"enable_gqa": enable_gqa} if enable_gqa else {}
    return fallback(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        **kw,
    )


def _flash_forward_meta(
    query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None
):
    """``_scaled_dot_product_flash_attention``'s outputs: the output in [B, L, H, D] memory,
    the fp32 log-sum-exp [B, H, L], the RNG seed and offset, an empty debug mask."""
    b, h, lq, _ = query.shape
    out = torch.empty(b, lq, h, value.shape[-1], dtype=query.dtype, device=query.device).transpose(
        1, 2
    )
    lse = torch.empty(b, h, lq, dtype=torch.float32, device=query.device)
    rng = torch.empty((), dtype=torch.long, device=query.device)
    return (
        out,
        lse,
        None,
        None,
        lq,
        key.shape[2],
        rng,
        torch.empty_like(rng),
        torch.empty(0, dtype=query.dtype, device=query.device),
    )


def _efficient_forward_meta(
    query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None
):
    """``_scaled_dot_product_efficient_attention``'s outputs: the output in [B, L, H, Dv] memory,
    the fp32 log-sum-exp [B, H, ⌈L⌉₃₂] (empty without gradients), the RNG seed and offset."""
    b, h, lq, _ = query.shape
    out = torch.empty(b, lq, h, value.shape[-1], dtype=query.dtype, device=query.device).transpose(
        1, 2
    )
    lse = torch.empty(
        b, h, _round(lq, 32) if compute_log_sumexp else 0, dtype=torch.float32, device=query.device
    )
    rng = torch.empty((), dtype=torch.long, device=query.device)
    return out, lse, rng, torch.empty_like(rng)


# Forward kernels torch 2.4 gives no Meta kernel (its backward kernels have them).
MISSING_META = {
    "_scaled_dot_product_flash_attention": _flash_forward_meta,
    "_scaled_dot_product_efficient_attention": _efficient_forward_meta,
}


def _round(x, m):
    return (x + m - 1) // m * m


def flash_backward_buffers(args, out):
    """``mha_bwd``: ``softmax_d`` [B, H, round128(L)] and ``dq_accum`` [B, round128(L), H, D
    rounded to 32 (≤ 128) or 64] in fp32, and under grouped-query attention dk and dv for every
    query head before they are summed into the key/value heads."""
    q, k = args[1], args[2]
    b, h, lq, d = q.shape
    lr = _round(lq, 128)
    sizes = [b * h * lr * 4, b * lr * h * _round(d, 32 if d <= 128 else 64) * 4]
    if k.shape[1] != h:
        sizes += [b * k.shape[2] * h * d * q.element_size()] * 2
    return sizes


def efficient_forward_buffers(args, out):
    """``_efficient_attention_forward``: half-precision kernels with a head dimension above 128
    accumulate the output in fp32 [B, L, H, Dv]."""
    q, v = args[0], args[2]
    if q.dtype in _HALF and v.shape[-1] > 128:
        return [q.shape[0] * q.shape[2] * q.shape[1] * v.shape[-1] * 4]
    return []


def efficient_backward_buffers(args, out):
    """``_efficient_attention_backward``'s ``delta`` [B, H, L] fp32; fp32 kernels compute it as
    (grad_out · out).sum(-1) from an fp32 product [B, L, H, Dv] made contiguous."""
    grad_out = args[0]
    b, h, lq, dv = grad_out.shape
    if grad_out.dtype in _HALF:
        return [b * h * lq * 4]
    return [b * lq * h * dv * 4, b * h * lq * 4, b * h * lq * 4]


# Buffers a kernel allocates and frees inside itself (op -> sizes in bytes from its arguments).
KERNEL_BUFFERS = {
    aten._scaled_dot_product_flash_attention_backward: flash_backward_buffers,
    aten._scaled_dot_product_efficient_attention: efficient_forward_buffers,
    aten._scaled_dot_product_efficient_attention_backward: efficient_backward_buffers,
}
