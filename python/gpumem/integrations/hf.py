"""``GpumemCallback``: a Hugging Face ``TrainerCallback`` that sizes the job at
``on_train_begin`` — the Trainer's own model (a meta copy of it), its arguments read as
``gpumem estimate --train-config`` reads a ``TrainingArguments`` file, the sequence length of a
batch its data collator makes — logs the estimate, and with ``stop_if_over=True`` stops the
run before its first step where the upper bound does not fit, saying the largest per-device
batch that does.

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[GpumemCallback(gpu="a100-40gb")])
"""

import logging

from transformers import TrainerCallback

import gpumem

logger = logging.getLogger("gpumem")


def sample_batch(dataloader, size):
    """A batch the data collator makes of the dataset's first ``size`` samples (the loader
    itself is not iterated: its sampler's order stays the run's), or ``None``."""
    dataset = getattr(dataloader, "dataset", None)
    collate = getattr(dataloader, "collate_fn", None)
    if collate is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        return None
    n = min(size, len(dataset))
    return collate([dataset[i] for i in range(n)]) if n else None


def sequence_length(batch):
    """The batch's token length, where it has token ids."""
    ids = batch.get("input_ids") if hasattr(batch, "get") else None
    return int(ids.shape[-1]) if getattr(ids, "dim", lambda: 0)() >= 2 else None


class GpumemCallback(TrainerCallback):
    """Sizes the Trainer's job on ``gpu`` (a built-in GPU, or ``profile``: a profile TOML's
    path) when training begins: ``self.estimate`` is the ``gpumem.Estimate``, also logged on
    the ``gpumem`` logger. ``stop_if_over``: raise ``gpumem.DoesNotFit`` (training stops
    before its first step) where the upper bound does not fit."""

    def __init__(self, gpu=gpumem.DEFAULT_GPU, profile=None, stop_if_over=False):
        self.gpu, self.profile, self.stop_if_over = gpu, profile, stop_if_over
        self.estimate = None

    def job(self, args, model, train_dataloader):
        """The keyword arguments of ``gpumem.estimate`` for the Trainer's job."""
        batch = sample_batch(train_dataloader, args.per_device_train_batch_size)
        return dict(
            seq_len=sequence_length(batch) if batch is not None else None,
            gpu=self.gpu,
            profile=self.profile,
            train_config=args.to_dict(),
            train_config_kind="hf-trainer",
        )

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        job = self.job(args, model, train_dataloader)
        self.estimate = gpumem.estimate(model, batch=args.per_device_train_batch_size, **job)
        logger.info("gpumem: %r", self.estimate)
        if self.stop_if_over and not self.estimate.upper_bound_fits:
            best = gpumem.max_batch(model, **job)
            raise gpumem.DoesNotFit(
                f"per_device_train_batch_size={args.per_device_train_batch_size} does not fit "
                f"{self.estimate.gpu} (upper bound {self.estimate.upper_bound / 2**20:.0f} MiB "
                f"of {self.estimate.capacity_mib:.0f} MiB); the largest that fits is {best}"
            )
