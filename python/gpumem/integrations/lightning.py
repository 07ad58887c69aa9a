"""``GpumemCallback``: a Lightning ``Callback`` that sizes the fit at ``on_fit_start`` — the
``LightningModule``'s own ``training_step`` on a batch of its training data, with the
``Trainer``'s optimizers and precision, recorded by ``gpumem.track`` (nothing moves to a GPU;
the module and optimizers are as they were afterwards) — logs the estimate, and with
``stop_if_over=True`` stops the fit before its first step where the upper bound does not fit,
saying the largest batch that does.

    trainer = L.Trainer(callbacks=[GpumemCallback(gpu="a100-40gb")])

Automatic optimization only (a module that steps its own optimizers is not sized here).
"""

import contextlib
import logging

import torch

try:
    import lightning.pytorch as pl
except ImportError:  # the package's older name
    import pytorch_lightning as pl

import gpumem

logger = logging.getLogger("gpumem")

# The Trainer's precision flags that autocast, and to what; "-true" ones cast the module.
_AUTOCAST = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


def _on_cuda(batch):
    if isinstance(batch, torch.Tensor):
        return batch.cuda()
    if isinstance(batch, (list, tuple)):
        return type(batch)(_on_cuda(b) for b in batch)
    if isinstance(batch, dict):
        return {k: _on_cuda(v) for k, v in batch.items()}
    return batch


def _resized(batch, size):
    """``batch`` with ``size`` samples: its first ones, or its samples repeated."""
    if isinstance(batch, torch.Tensor) and batch.dim() > 0:
        reps = -(-size // batch.shape[0])
        return batch.repeat(reps, *[1] * (batch.dim() - 1))[:size]
    if isinstance(batch, (list, tuple)):
        return type(batch)(_resized(b, size) for b in batch)
    if isinstance(batch, dict):
        return {k: _resized(v, size) for k, v in batch.items()}
    return batch


def _length(batch):
    if isinstance(batch, torch.Tensor) and batch.dim() > 0:
        return int(batch.shape[0])
    values = batch.values() if isinstance(batch, dict) else batch
    if isinstance(values, (list, tuple)) or isinstance(batch, dict):
        return next((n for n in map(_length, values) if n), None)
    return None


def sample_batch(trainer, module):
    """A batch of the fit's training data (the random state as it was before: the fit's
    shuffling stays its own)."""
    source = trainer.datamodule if trainer.datamodule is not None else module
    rng = torch.random.get_rng_state()
    try:
        return next(iter(source.train_dataloader()))
    finally:
        torch.random.set_rng_state(rng)


class GpumemCallback(pl.Callback):
    """Sizes the fit on ``gpu`` (a built-in GPU; ``profile``: a profile TOML's path to size it
    on instead) when it starts: ``self.estimate`` is the ``gpumem.Estimate``, also logged on the
    ``gpumem`` logger. ``steps`` optimizer steps are recorded. ``stop_if_over``: raise
    ``gpumem.DoesNotFit`` (the fit stops before its first step) where the upper bound does not
    fit."""

    def __init__(self, gpu=gpumem.DEFAULT_GPU, profile=None, stop_if_over=False, steps=3):
        self.gpu, self.profile, self.stop_if_over, self.steps = gpu, profile, stop_if_over, steps
        self.estimate = None

    def size(self, trainer, module, batch):
        """The estimate of the module's training step on ``batch``."""
        if not module.automatic_optimization:
            raise gpumem.InputError("GpumemCallback sizes automatic optimization only")
        optimizers = list(trainer.optimizers)
        dtype = _AUTOCAST.get(str(trainer.precision))
        quiet = dict(log=lambda *a, **k: None, log_dict=lambda *a, **k: None)
        with contextlib.ExitStack() as stack:
            for name, f in quiet.items():  # self.log needs the fit loop's results
                stack.enter_context(_attribute(module, name, f))
            with gpumem.track(module, optimizers, gpu=self.gpu) as t:
                scaler = torch.amp.GradScaler("cuda") if dtype is torch.float16 else None
                on_gpu = None
                for i in range(self.steps):
                    on_gpu = None  # the loop's last batch goes before the next arrives
                    on_gpu = _on_cuda(batch)
                    cast = (
                        torch.autocast("cuda", dtype=dtype) if dtype else contextlib.nullcontext()
                    )
                    with cast:
                        out = module.training_step(on_gpu, i)
                    loss = out["loss"] if isinstance(out, dict) else out
                    (scaler.scale(loss) if scaler else loss).backward()
                    for o in optimizers:
                        scaler.step(o) if scaler else o.step()
                    if scaler:
                        scaler.update()
                    for o in optimizers:
                        o.zero_grad(set_to_none=True)
        return t.estimate(gpu=self.gpu, profile=self.profile)

    def largest_batch(self, trainer, module, batch):
        """The largest batch whose upper bound fits (0: not even one), by doubling then
        bisection over the batch's samples resized."""
        fits = lambda n: self.size(trainer, module, _resized(batch, n)).upper_bound_fits
        if not fits(1):
            return 0
        low, high = 1, 2
        while fits(high):
            low, high = high, high * 2
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low

    def on_fit_start(self, trainer, pl_module):
        batch = sample_batch(trainer, pl_module)
        self.estimate = self.size(trainer, pl_module, batch)
        logger.info("gpumem: %r", self.estimate)
        if self.stop_if_over and not self.estimate.upper_bound_fits:
            best = self.largest_batch(trainer, pl_module, batch)
            raise gpumem.DoesNotFit(
                f"a batch of {_length(batch)} does not fit {self.estimate.gpu} (upper bound "
                f"{self.estimate.upper_bound / 2**20:.0f} MiB of {self.estimate.capacity_mib:.0f}"
                f" MiB); the largest that fits is {best}"
            )


@contextlib.contextmanager
def _attribute(obj, name, value):
    saved = obj.__dict__.get(name, _MISSING)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if saved is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, saved)


_MISSING = object()
