"""torch.autocast as it behaves on CUDA, emulated for meta tensors (spec §5).

A ``TorchFunctionMode`` casts the arguments of the ops in CUDA's autocast lists: matmul-like ops
run in the low dtype (parameters are cast once per forward and cached, other fp32 tensors are
cast every time), a set of ops run in fp32, softmax-like ops produce fp32 (fp16 input has a fused
half→float kernel; bf16 input is converted first), and a few ops promote to the widest dtype.
"""

import contextlib
import functools
import inspect
import types

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.overrides import TorchFunctionMode

aten = torch.ops.aten


def _entry_points(*names, modules=(torch, torch.Tensor, F, torch.linalg)):
    """Every Python function that reaches the named ATen ops (``torch.exp``, ``Tensor.exp``,
    ``F.softplus`` …), where this torch has it."""
    return {getattr(m, n) for n in names for m in modules if callable(getattr(m, n, None))}


# CUDA autocast's op lists (aten/src/ATen/autocast_mode.h: AT_FORALL_LOWER_PRECISION_FP,
# AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_PROMOTE), unchanged from 2.4 to 2.15
# but for rms_norm (fp32 from 2.12); see docs/sdpa.md.
LOW = _entry_points(
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "einsum",
    "mm",
    "mv",
    "vecdot",
    "linear",
    "addbmm",
    "baddbmm",
    "bmm",
    "chain_matmul",
    "multi_dot",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "scaled_dot_product_attention",
) | {torch.Tensor.__matmul__, torch.Tensor.__rmatmul__}
FP32 = _entry_points(
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow",
    "softplus",
    "layer_norm",
    "group_norm",
    "frobenius_norm",
    "nuclear_norm",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "interpolate",
    "upsample",
    "upsample_nearest",
    "upsample_bilinear",
    "norm",
    "normalize",
    *(["rms_norm"] if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 12) else []),
) | {torch.Tensor.__pow__, torch.Tensor.__rpow__}
# Ops that compute in fp32 unless given a dtype (fp32_set_opt_dtype); softmax has its own path.
SET_OPT_DTYPE = _entry_points("prod", "cumprod", "cumsum", "sum", "vector_norm", "matrix_norm")
SOFTMAX = {
    F.softmax: False,
    torch.softmax: False,
    torch.Tensor.softmax: False,
    F.log_softmax: True,
    torch.log_softmax: True,
    torch.Tensor.log_softmax: True,
}
PROMOTE = _entry_points(
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "vdot",
    "grid_sample",
    "index_put",
    "tensordot",
    "scatter_add",
)


def _map(x, fn):
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map(y, fn) for y in x)
    if isinstance(x, dict):
        return {k: _map(v, fn) for k, v in x.items()}
    return x


# The emulated autocast modes entered now, innermost last (``torch.autocast`` calls in model
# code pause or start them).
_ACTIVE = []


class Autocast(TorchFunctionMode):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype
        self.cache = {}
        self.depth = 0  # how many `with` blocks are open: checkpoint asks at forward time
        self.enabled = True  # False inside the model's own `torch.autocast(..., enabled=False)`

    def __enter__(self):
        self.depth += 1
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        self.depth -= 1
        _ACTIVE.pop()
        return super().__exit__(*exc)

    def low(self, t):
        if not (t.is_floating_point() and t.dtype == torch.float32):
            return t
        # CUDA's cache (autocast_mode.cpp, cached_cast): fp32 leaves that require grad, not
        # views of them (a weight's `.t()` made where grad is off is such a leaf).
        if t.is_leaf and t.requires_grad and not t._is_view():
            c = self.cache.get(id(t))
            if c is None or c[0]() is not t:
                import weakref

                c = (weakref.ref(t), t.to(self.dtype))
                self.cache[id(t)] = c
            return c[1]
        return t.to(self.dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Autocast's lists hold the functional ops: an `out=` variant runs as it is called.
        if not self.enabled or kwargs.get("out") is not None:
            return func(*args, **kwargs)
        if func in LOW or getattr(func, "autocast_low", False):
            return func(*_map(args, self.low), **_map(kwargs, self.low))
        if func in FP32:
            up = lambda t: t.float() if t.is_floating_point() and t.dtype != torch.float32 else t
            return func(*_map(args, up), **_map(kwargs, up))
        if (
            func in SET_OPT_DTYPE
            and kwargs.get("dtype") is None
            and args
            and isinstance(args[0], torch.Tensor)
            and args[0].dtype in (torch.float16, torch.bfloat16)
        ):
            return func(*args, **kwargs, dtype=torch.float32)
        if func in SOFTMAX:
            return self.softmax(func, SOFTMAX[func], args, kwargs)
        if func is F.cross_entropy:
            return self.cross_entropy(args, kwargs)
        if func in PROMOTE:
            ts = [t for t in _flat(args) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if ts:
                wide = max((t.dtype for t in ts), key=lambda d: torch.finfo(d).bits)
                return func(
                    *_map(
                        args,
                        lambda t: t.to(wide) if t.is_floating_point() and t.dtype != wide else t,
                    ),
                    **kwargs,
                )
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
        names = [
            "input",
            "target",
            "weight",
            "size_average",
            "ignore_index",
            "reduce",
            "reduction",
            "label_smoothing",
        ]
        a = dict(zip(names, args))
        a.update(kwargs)
        if a.get("label_smoothing", 0.0) or a["input"].dim() < 2 or a["target"].is_floating_point():
            return F.cross_entropy(
                a["input"].float(),
                a["target"],
                **{k: v for k, v in a.items() if k not in ("input", "target")},
            )
        logp = self.softmax(F.log_softmax, True, (a["input"], 1), {})
        return F.nll_loss(
            logp,
            a["target"],
            weight=a.get("weight"),
            ignore_index=a.get("ignore_index", -100),
            reduction=a.get("reduction", "mean"),
        )

    def clear(self):
        self.cache.clear()

    @contextlib.contextmanager
    def under_checkpoint(self):
        """torch.utils.checkpoint recomputes a segment in backward under the autocast state of
        its forward (it re-enters ``torch.autocast``; leaving it clears the cast cache). This
        mode is not torch.autocast, so it joins both kinds of checkpoint: non-reentrant ones get
        a default ``context_fn`` whose recompute context does the same with this mode (standing,
        for the while, as torch's no-op context function too, which reentrant calls insist on);
        a reentrant one (Hugging Face's default before transformers 5) recomputes by calling the
        segment's function a second time, which then runs under this mode where the first did."""
        ckpt = torch.utils.checkpoint
        inner = inspect.unwrap(ckpt.checkpoint)
        default, noop, reentrant_forward = (
            inner.__kwdefaults__["context_fn"],
            ckpt.noop_context_fn,
            ckpt.CheckpointFunction.forward,
        )

        def context_fn():
            return contextlib.nullcontext(), self.recompute_context()

        def forward(ctx, run_function, *args):
            return reentrant_forward(ctx, self._recomputed_as_forward_ran(run_function), *args)

        inner.__kwdefaults__["context_fn"] = ckpt.noop_context_fn = context_fn
        ckpt.CheckpointFunction.forward = staticmethod(forward)
        try:
            yield
        finally:
            inner.__kwdefaults__["context_fn"], ckpt.noop_context_fn = default, noop
            ckpt.CheckpointFunction.forward = staticmethod(reentrant_forward)

    def _recomputed_as_forward_ran(self, function):
        """``function`` (a reentrant checkpoint's segment, called now by its forward) whose later
        calls, the recomputation in backward, run under this mode where this one does."""
        if not self.depth:
            return function
        calls = 0

        def run(*args, **kwargs):
            nonlocal calls
            calls += 1
            if calls == 1:
                return function(*args, **kwargs)
            with self._recompute():
                return function(*args, **kwargs)

        return run

    def recompute_context(self):
        """What a checkpointed segment's recomputation runs under: this mode where the forward
        ran under it (asked while the forward runs), else nothing."""
        return self._recompute() if self.depth else contextlib.nullcontext()

    @contextlib.contextmanager
    def _recompute(self):
        # Non-reentrant checkpoint stops a recomputation early by raising through this context
        # once it has what backward needs: the cast cache is cleared then too (a stale entry
        # would keep a layer's cast weights alive into the next forward, which would not cast
        # them again).
        try:
            with self:
                yield
        finally:
            self.clear()


_REAL_AUTOCAST = torch.autocast


class _AutocastCall:
    """``torch.autocast(...)`` as model code calls it while tracing. The job runs on a CUDA
    device (the tracer's tensors are on meta), so CUDA autocast is emulated: ``enabled=False``
    pauses the emulated mode (rotary embeddings computed in fp32), ``enabled=True`` starts one
    with its dtype (a model that autocasts itself); other devices' autocast is the real one."""

    def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        self.args = (device_type, dtype, enabled)
        self.real = (
            None
            if device_type in ("cuda", "meta")
            else _REAL_AUTOCAST(
                device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled
            )
        )
        self.undo = []

    def __enter__(self):
        if self.real is not None:
            return self.real.__enter__()
        _, dtype, enabled = self.args
        outer = _ACTIVE[-1] if _ACTIVE else None
        if not enabled and outer is not None and outer.enabled:
            outer.enabled = False
            self.undo.append(lambda: setattr(outer, "enabled", True))
        elif enabled and (
            outer is None or not outer.enabled or outer.dtype != (dtype or torch.float16)
        ):
            mode = Autocast(dtype or torch.float16)
            mode.__enter__()
            self.undo.append(lambda: (mode.__exit__(None, None, None), mode.clear()))
        return self

    def __exit__(self, *exc):
        if self.real is not None:
            return self.real.__exit__(*exc)
        while self.undo:
            self.undo.pop()()
        return False

    def __call__(self, fn):  # used as a decorator
        @functools.wraps(fn)
        def wrapped(*a, **k):
            with _AutocastCall(*self.args):
                return fn(*a, **k)

        return wrapped


def active_dtype():
    """The dtype the emulated autocast casts to here, or None where it is off: what
    ``torch.is_autocast_enabled()``/``torch.get_autocast_dtype("cuda")`` answer on the GPU."""
    mode = _ACTIVE[-1] if _ACTIVE else None
    return mode.dtype if mode is not None and mode.enabled else None


@contextlib.contextmanager
def model_autocast_calls():
    """Routes ``torch.autocast`` / ``torch.amp.autocast`` / ``torch.cuda.amp.autocast`` calls in
    model code to the emulation while tracing."""
    cuda_amp = getattr(torch.cuda, "amp", None)
    saved = (torch.autocast, torch.amp.autocast, getattr(cuda_amp, "autocast", None))
    torch.autocast = torch.amp.autocast = _AutocastCall
    if cuda_amp is not None:
        cuda_amp.autocast = lambda enabled=True, dtype=torch.float16, cache_enabled=True: (
            _AutocastCall("cuda", dtype, enabled)
        )
    try:
        yield
    finally:
        torch.autocast, torch.amp.autocast = saved[0], saved[1]
        if cuda_amp is not None:
            cuda_amp.autocast = saved[2]


_GUARDS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


def _unguarded(func):
    """A copy of a ``torch.nn.functional`` Python function whose ``has_torch_function`` guards
    say no, so its body runs under the mode instead of dispatching to it again; ``None`` for
    anything else. Judged by where the code lives, not ``__module__``: ``boolean_dispatch``
    wrappers (``F.max_pool2d``) claim to be functional's but call guarded functions that would
    dispatch straight back here."""
    g = getattr(func, "__globals__", None)
    if (
        not isinstance(func, types.FunctionType)
        or g is None
        or func.__code__.co_filename != F.__file__
    ):
        return None
    no = lambda *a, **k: False
    clone = types.FunctionType(
        func.__code__,
        {**g, **{n: no for n in _GUARDS}},
        func.__name__,
        func.__defaults__,
        func.__closure__,
    )
    clone.__kwdefaults__ = func.__kwdefaults__
    return clone


def _flat(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat(y)
    else:
        yield x
