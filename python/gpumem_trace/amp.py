"""torch.autocast as it behaves on CUDA, emulated for meta tensors (spec §5).

A ``TorchFunctionMode`` casts the arguments of the ops in CUDA's autocast lists: matmul-like ops
run in the low dtype (parameters are cast once per forward and cached, other fp32 tensors are
cast every time), a set of ops run in fp32, softmax-like ops produce fp32 (fp16 input has a fused
half→float kernel; bf16 input is converted first), and a few ops promote to the widest dtype.
"""

import contextlib
import inspect
import types

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

aten = torch.ops.aten

LOW = {
    F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.mm, torch.Tensor.mm,
    torch.bmm, torch.Tensor.bmm, torch.baddbmm, torch.Tensor.baddbmm, torch.addmm, torch.Tensor.addmm, torch.addbmm,
    torch.addmv, torch.mv, torch.einsum, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
    F.conv_transpose3d, F.prelu, torch.chain_matmul, torch.addr,
}
FP32 = {
    F.layer_norm, torch.layer_norm, F.group_norm, torch.group_norm, F.softplus, torch.exp, torch.Tensor.exp,
    torch.log, torch.Tensor.log, torch.pow, torch.Tensor.pow, torch.rsqrt, torch.reciprocal, torch.log1p, torch.expm1,
    F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.nll_loss, F.binary_cross_entropy_with_logits, F.kl_div,
    F.cosine_similarity, torch.cdist, torch.dist, torch.norm, F.normalize, torch.logsumexp, F.interpolate,
    F.multilabel_margin_loss, F.soft_margin_loss, F.margin_ranking_loss, F.poisson_nll_loss, F.cosine_embedding_loss,
}
SOFTMAX = {F.softmax: False, torch.softmax: False, torch.Tensor.softmax: False, F.log_softmax: True, torch.log_softmax: True, torch.Tensor.log_softmax: True}
PROMOTE = {torch.cat, torch.stack, torch.addcmul, torch.addcdiv, torch.atan2, torch.cross, torch.dot, torch.vdot, torch.tensordot, torch.index_put}


def _map(x, fn):
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map(y, fn) for y in x)
    if isinstance(x, dict):
        return {k: _map(v, fn) for k, v in x.items()}
    return x


class Autocast(TorchFunctionMode):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype
        self.cache = {}
        self.depth = 0  # how many `with` blocks are open: checkpoint asks at forward time

    def __enter__(self):
        self.depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self.depth -= 1
        return super().__exit__(*exc)

    def low(self, t):
        if not (t.is_floating_point() and t.dtype == torch.float32):
            return t
        if t.is_leaf and t.requires_grad:
            c = self.cache.get(id(t))
            if c is None or c[0]() is not t:
                import weakref

                c = (weakref.ref(t), t.to(self.dtype))
                self.cache[id(t)] = c
            return c[1]
        return t.to(self.dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in LOW:
            return func(*_map(args, self.low), **_map(kwargs, self.low))
        if func in FP32:
            up = lambda t: t.float() if t.is_floating_point() and t.dtype != torch.float32 else t  # noqa: E731
            return func(*_map(args, up), **_map(kwargs, up))
        if func in SOFTMAX:
            return self.softmax(func, SOFTMAX[func], args, kwargs)
        if func is F.cross_entropy:
            return self.cross_entropy(args, kwargs)
        if func in PROMOTE:
            ts = [t for t in _flat(args) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if ts:
                wide = max((t.dtype for t in ts), key=lambda d: torch.finfo(d).bits)
                return func(*_map(args, lambda t: t.to(wide) if t.is_floating_point() and t.dtype != wide else t), **kwargs)
        inner = _unguarded(func)
        if inner is None:
            return func(*args, **kwargs)
        # A Python function that dispatched to us as a whole (multi_head_attention_forward, say):
        # run its body with this mode active again, so the ops inside it are cast too.
        with self:
            return inner(*args, **kwargs)

    def softmax(self, func, log, args, kwargs):
        x = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
        if x.dtype == torch.float16:
            op = aten._log_softmax if log else aten._softmax
            return op(x, dim if dim is not None else -1, True)
        if x.is_floating_point() and x.dtype != torch.float32:
            x = x.float()
        return func(x, dim)

    def cross_entropy(self, args, kwargs):
        names = ["input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing"]
        a = dict(zip(names, args))
        a.update(kwargs)
        if a.get("label_smoothing", 0.0) or a["input"].dim() < 2 or a["target"].is_floating_point():
            return F.cross_entropy(a["input"].float(), a["target"], **{k: v for k, v in a.items() if k not in ("input", "target")})
        logp = self.softmax(F.log_softmax, True, (a["input"], 1), {})
        return F.nll_loss(logp, a["target"], weight=a.get("weight"), ignore_index=a.get("ignore_index", -100), reduction=a.get("reduction", "mean"))

    def clear(self):
        self.cache.clear()

    @contextlib.contextmanager
    def under_checkpoint(self):
        """torch.utils.checkpoint recomputes a segment in backward under the autocast state of
        its forward (it re-enters ``torch.autocast``; leaving it clears the cast cache). This
        mode is not torch.autocast, so give non-reentrant checkpoint a default ``context_fn``
        whose recompute context does the same with this mode."""
        inner = inspect.unwrap(torch.utils.checkpoint.checkpoint)
        saved = inner.__kwdefaults__["context_fn"]

        def context_fn():
            return contextlib.nullcontext(), (self._recompute() if self.depth else contextlib.nullcontext())

        inner.__kwdefaults__["context_fn"] = context_fn
        try:
            yield
        finally:
            inner.__kwdefaults__["context_fn"] = saved

    @contextlib.contextmanager
    def _recompute(self):
        with self:
            yield
        self.clear()


_GUARDS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


def _unguarded(func):
    """A copy of a ``torch.nn.functional`` Python function whose ``has_torch_function`` guards
    say no, so its body runs under the mode instead of dispatching to it again; ``None`` for
    anything else. Judged by where the code lives, not ``__module__``: ``boolean_dispatch``
    wrappers (``F.max_pool2d``) claim to be functional's but call guarded functions that would
    dispatch straight back here."""
    g = getattr(func, "__globals__", None)
    if not isinstance(func, types.FunctionType) or g is None or func.__code__.co_filename != F.__file__:
        return None
    no = lambda *a, **k: False  # noqa: E731
    clone = types.FunctionType(func.__code__, {**g, **{n: no for n in _GUARDS}}, func.__name__, func.__defaults__, func.__closure__)
    clone.__kwdefaults__ = func.__kwdefaults__
    return clone


def _flat(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat(y)
    else:
        yield x
