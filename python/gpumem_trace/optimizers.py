"""The optimizers gpumem names (``Optimizer::name`` in gpumem's job vocabulary, the request's
``optimizer``), built as their libraries build them, to step on meta tensors.

- torch.optim's classes (Adam, AdamW, SGD, Adagrad, RMSprop, Adafactor, Muon) are the real ones
  with the named implementation (``foreach=False``, ``foreach=True``, ``fused=True``). A fused
  kernel checks that its parameters are on a device with fused kernels (meta is not one): the
  check is given meta while the step runs; fused kernels without a meta kernel (``_fused_sgd_``)
  get one that does what the CUDA kernel does to memory — nothing, it works in place.
- transformers' Adafactor is the real class, as Hugging Face's Trainer makes it.
- transformers' own AdamW (``optim="adamw_hf"``) is the real class where the installed
  transformers still has it; newer ones removed it, and ``TransformersAdamW`` restates its step.
- Muon takes only 2-D parameters; the others go to torch's AdamW (foreach), as torch's
  documentation pairs them: one optimizer over both (``MuonWithAdamW``).
- bitsandbytes' classes are the real ones: their own ``init_state`` makes the state (its
  formats, the quantization maps, which states are paged). Their CUDA update kernels, which
  write the parameters and states in place, are not run. A paged state is CUDA managed memory
  (``F.get_paged``): here a meta tensor marked ``is_paged``, recorded as host-backed.
- torchao's low-bit AdamW: the real class and its own ``_new_buffer`` (the block-quantized
  tensor subclasses, or a plain tensor where torchao keeps one), made at the first step as its
  ``step`` makes them; its compiled ``single_param_adam``, one fused kernel per parameter that
  updates in place, is not run (torch.compile does not run on meta tensors).
"""

import contextlib
import functools
import importlib
import math

import torch

from .models import ReferenceError_

# How each implementation is asked for.
_IMPLEMENTATIONS = {
    "": {"foreach": True},
    "-for-loop": {"foreach": False},
    "-fused": {"fused": True},
}


@contextlib.contextmanager
def fused_on_meta():
    """torch.optim's fused kernels accept meta parameters while this is open."""
    mod = importlib.import_module("torch.optim.optimizer")
    devices = getattr(mod, "_get_fused_kernels_supported_devices", None)
    if devices is None:  # torch without the check
        yield
        return
    mod._get_fused_kernels_supported_devices = lambda: [*devices(), "meta"]
    try:
        yield
    finally:
        mod._get_fused_kernels_supported_devices = devices


_META_KERNELS = []


def _meta_in_place(*ops):
    """Meta kernels for in-place fused optimizer ops that have none (the CUDA kernel allocates
    nothing)."""
    if _META_KERNELS:
        return
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - kept for the process
    for op in ops:
        if not hasattr(torch.ops.aten, op):
            continue
        try:
            lib.impl(op, lambda *a, **k: None, "Meta")
        except RuntimeError:
            pass  # the torch has its own
    _META_KERNELS.append(lib)


def _with_step_wrapped(opt, around):
    step = opt.step

    @functools.wraps(step)
    def wrapped(*a, **k):
        with around():
            return step(*a, **k)

    opt.step = wrapped
    return opt


def _torch(cls_name, suffix, **kwargs):
    def build(params, lr):
        cls = getattr(torch.optim, cls_name, None)
        if cls is None:
            raise ReferenceError_(
                f"torch {torch.__version__} has no torch.optim.{cls_name} (a newer torch has)"
            )
        how = _IMPLEMENTATIONS[suffix]
        if "fused" in how:
            _meta_in_place("_fused_sgd_", "_fused_adagrad_")
            return _with_step_wrapped(cls(params, lr=lr, **kwargs, **how), fused_on_meta)
        return cls(params, lr=lr, **kwargs, **how)

    return build


def _transformers_adafactor(params, lr):
    try:
        from transformers.optimization import Adafactor
    except ImportError as e:
        raise ReferenceError_(f"optimizer adafactor needs transformers: {e}") from e
    # Hugging Face's Trainer for optim="adafactor" (trainer_optimizer._get_adafactor).
    return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False)


class TransformersAdamW(torch.optim.Optimizer):
    """transformers' own ``AdamW`` (``transformers.optimization.AdamW``), what Hugging Face's
    Trainer made for ``optim="adamw_hf"`` (its default until transformers 4.32): restated for the
    transformers that no longer have it (removed in 2025, transformers PR 36177). Per parameter:
    its moments, made the first time it is stepped; ``denom = exp_avg_sq.sqrt().add_(eps)``; the
    rest in place."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(p.grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1.0 - beta2)
                denom = exp_avg_sq.sqrt().add_(group["eps"])
                bias1, bias2 = 1.0 - beta1 ** state["step"], 1.0 - beta2 ** state["step"]
                p.addcdiv_(exp_avg, denom, value=-group["lr"] * math.sqrt(bias2) / bias1)
                if group["weight_decay"] > 0.0:
                    p.add_(p, alpha=-group["lr"] * group["weight_decay"])


def _transformers_adamw(params, lr):
    try:
        from transformers.optimization import AdamW
    except ImportError:
        AdamW = TransformersAdamW
    if issubclass(AdamW, torch.optim.AdamW):  # the name kept for torch's, after the removal
        AdamW = TransformersAdamW
    return AdamW(params, lr=lr)


class MuonWithAdamW:
    """torch.optim.Muon over the 2-D parameters and torch.optim.AdamW (foreach) over the rest,
    stepped one after the other as a trainer steps its pair."""

    def __init__(self, params, lr):
        if not hasattr(torch.optim, "Muon"):
            raise ReferenceError_(
                f"torch {torch.__version__} has no torch.optim.Muon (torch 2.9 and later have)"
            )
        params = list(params)
        matrices = [p for p in params if p.ndim == 2]
        others = [p for p in params if p.ndim != 2]
        self.parts = []
        if matrices:
            self.parts.append(torch.optim.Muon(matrices, lr=lr))
        if others:
            self.parts.append(torch.optim.AdamW(others, lr=lr, foreach=True))

    @property
    def param_groups(self):
        return [g for o in self.parts for g in o.param_groups]

    @property
    def state(self):
        return {p: s for o in self.parts for p, s in o.state.items()}

    def zero_grad(self, set_to_none=True):
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self):
        for o in self.parts:
            o.step()


@contextlib.contextmanager
def _bnb_managed_on_meta():
    """bitsandbytes' managed memory (``F.get_paged``) as meta tensors marked ``is_paged``."""
    import bitsandbytes.functional as F

    saved = F.get_paged, F.fill, F.prefetch_tensor

    def get_paged(*shape, dtype=torch.float32, device=None):
        out = torch.zeros(shape, dtype=dtype, device=device)
        out.is_paged = True
        return out

    F.get_paged, F.fill, F.prefetch_tensor = get_paged, lambda *a, **k: None, lambda *a, **k: None
    try:
        yield
    finally:
        F.get_paged, F.fill, F.prefetch_tensor = saved


def _bnb(cls_name):
    def build(params, lr):
        try:
            import bitsandbytes.optim as bnb_optim
        except ImportError as e:
            raise ReferenceError_(f"bitsandbytes optimizers need bitsandbytes: {e}") from e
        opt = getattr(bnb_optim, cls_name)(params, lr=lr)
        # The CUDA kernels update in place; there are none to run on meta.
        opt.update_step = lambda *a, **k: None

        return _with_step_wrapped(opt, _bnb_managed_on_meta)

    return build


@contextlib.contextmanager
def device_data_seen():
    """``torch.tensor(data, device=d)`` copies its data to ``d`` outside the dispatcher, where no
    dispatch mode sees the memory it takes (torchao's quantization maps): while this is open,
    such a tensor is made on the host and moved, and the move is seen."""
    real = torch.tensor

    def tensor(data, *args, device=None, **kwargs):
        if device is None or torch.device(device).type == "cpu":
            return real(data, *args, device=device, **kwargs)
        return real(data, *args, **kwargs).to(device)

    torch.tensor = tensor
    try:
        yield
    finally:
        torch.tensor = real


def _torchao(cls_name):
    def build(params, lr):
        try:
            import torchao.optim as ao
        except ImportError as e:
            raise ReferenceError_(f"torchao optimizers need torchao: {e}") from e
        cls = getattr(ao, cls_name)

        class OnMeta(cls):
            @torch.no_grad()
            def step(self, closure=None):
                # torchao's _AdamBase.step without its compiled kernel (in place).
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is None:
                            continue
                        state = self.state[p]
                        if len(state) == 0:
                            state["step"] = torch.tensor(0.0)
                            state["exp_avg"] = self._new_buffer(p, True)
                            state["exp_avg_sq"] = self._new_buffer(p, False)
                        state["step"] += 1

        OnMeta.__name__ = OnMeta.__qualname__ = cls.__name__
        return _with_step_wrapped(OnMeta(params, lr=lr), device_data_seen)

    return build


def _named():
    table = {}
    for suffix in _IMPLEMENTATIONS:
        table["adam" + suffix] = _torch("Adam", suffix)
        table["adamw" + suffix] = _torch("AdamW", suffix)
        table["sgd" + suffix] = _torch("SGD", suffix)
        table["sgd-momentum" + suffix] = _torch("SGD", suffix, momentum=0.9)
    for suffix in ("", "-for-loop"):
        table["adagrad" + suffix] = _torch("Adagrad", suffix)
        table["rmsprop" + suffix] = _torch("RMSprop", suffix)
        table["torch-adafactor" + suffix] = _torch("Adafactor", suffix)
    table["transformers-adamw"] = _transformers_adamw
    table["adafactor"] = _transformers_adafactor
    table["muon"] = MuonWithAdamW
    for paged in ("", "paged-"):
        for bits in ("8bit", "32bit"):
            for alg, cls in (("adam", "Adam"), ("adamw", "AdamW"), ("lion", "Lion")):
                table[f"{paged}{alg}{bits}"] = _bnb(f"{'Paged' if paged else ''}{cls}{bits}")
    table["torchao-adamw8bit"] = _torchao("AdamW8bit")
    table["torchao-adamw4bit"] = _torchao("AdamW4bit")
    table["torchao-adamw-fp8"] = _torchao("AdamWFp8")
    return table


# gpumem's names, as the request carries them (the request's schema lists the same).
OPTIMIZERS = _named()


def make(name, params, lr):
    """The optimizer gpumem calls ``name``, over ``params``."""
    build = OPTIMIZERS.get(name)
    if build is None:
        raise ReferenceError_(
            f"unknown optimizer `{name}` (expected one of gpumem's names: {', '.join(OPTIMIZERS)})"
        )
    return build(params, lr)


class InBackward:
    """The optimizer stepping inside backward (torchtune's ``optimizer_in_bwd``): one optimizer
    per parameter, stepped by that parameter's post-accumulate-grad hook as soon as its gradient
    is ready, which it then frees (``zero_grad``) — so the gradients never all live at once.
    The hooks are torchtune's own ``register_optim_in_bwd_hooks`` where torchtune imports, else
    the same two lines. The loop's ``step`` and ``zero_grad`` then have nothing left to do."""

    def __init__(self, params, build, on_grad=lambda grad: None):
        self.optimizers = {p: build([p]) for p in params}
        self.on_grad = on_grad  # told of each gradient before its step (the trace's label)
        try:
            register = importlib.import_module("torchtune.training").register_optim_in_bwd_hooks
        except (ImportError, AttributeError):
            register = None
        if register is not None:
            holder = torch.nn.Module()  # torchtune hooks a model's trainable parameters
            for i, p in enumerate(self.optimizers):
                holder.register_parameter(f"p{i}", p)
            for p in self.optimizers:
                p.register_post_accumulate_grad_hook(lambda p: self.on_grad(p.grad))
            register(holder, self.optimizers)
        else:
            for p in self.optimizers:
                p.register_post_accumulate_grad_hook(self._step)

    def _step(self, param):
        self.on_grad(param.grad)
        self.optimizers[param].step()
        self.optimizers[param].zero_grad()

    @property
    def state(self):
        return {p: o.state[p] for p, o in self.optimizers.items() if p in o.state}

    def step(self):
        pass

    def zero_grad(self, set_to_none=True):
        pass


def _inner(t):
    """The plain tensors holding a tensor's memory (a torchao state's codes, scales and map)."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None and type(t) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        for n in names:
            # Only the tensors: a DTensor (FSDP2's state) also names its DeviceMesh on newer torch.
            inner = getattr(t, n)
            if isinstance(inner, torch.Tensor):
                yield from _inner(inner)
    else:
        yield t


def state_tensors(optimizer, device):
    """The optimizer's state on ``device`` as ``(tensor, category)``: ``optimizer_state``, or
    ``host_backed`` for bitsandbytes' paged (managed) states."""
    for state in getattr(optimizer, "state", {}).values():
        for v in state.values():
            if not isinstance(v, torch.Tensor):
                continue
            paged = getattr(v, "is_paged", False)
            for t in _inner(v):
                if t.device.type == device:
                    yield t, "host_backed" if paged else "optimizer_state"


def resume_as_torch_load(optimizer, rec):
    """The optimizer state read back at resume as Hugging Face's Trainer reads it (and
    torchtune's single-device recipes): ``torch.load(map_location=device)`` puts every state
    tensor on the GPU, then ``optimizer.load_state_dict`` keeps them as they are (same device
    and dtype: no copy). The state's layout is the optimizer's own, made by PyTorch's
    ``_init_optim_state`` (a step on zero gradients at learning rate 0) on the host, where the
    trace does not count it; each tensor of it is then read onto the GPU. Adam's ``step``
    counters stay host tensors here (a few bytes each on a real GPU). With the optimizer in
    backward, each parameter's optimizer resumes so."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    for each in optimizer.optimizers.values() if isinstance(optimizer, InBackward) else [optimizer]:
        with rec.on_host():
            _init_optim_state(each)
            on_host = each.state_dict()
        read = {
            **on_host,
            "state": {
                k: {n: torch.empty_like(v) if _on_gpu(v) else v for n, v in state.items()}
                for k, state in on_host["state"].items()
            },
        }
        del on_host
        each.load_state_dict(read)
        del read


def _on_gpu(v):
    return isinstance(v, torch.Tensor) and v.is_meta
