"""Hugging Face's own ``Trainer`` run on the stand-in CUDA (standin.py): its evaluation loop
(``Trainer.evaluate`` → ``evaluation_loop`` → ``prediction_step``), transformers' and
accelerate's code unmodified, on the model the trace trained.

What the Trainer is given stands for what the job states: batches of the job's shapes (zeros,
made by the data collator), ``per_device_eval_batch_size``, ``eval_accumulation_steps``, the
precision's ``bf16``/``fp16`` flag (accelerate's autocast and fp32 outputs), and, where the job
computes metrics, a ``compute_metrics`` — which makes the loop keep logits and labels.

One thing is not the Trainer's: the arrays it keeps on the host. ``nested_numpify`` (what
``EvalLoopContainer`` calls to move what it holds off the GPU) gives arrays of no rows, of the
right dtype and trailing shape: the GPU tensors die as they would (``.cpu()`` allocates nothing
on the GPU), and the tracer's machine need not hold an evaluation set's logits in its own
memory, as the job's host must.
"""

import tempfile
import warnings

import numpy as np
import torch

from . import standin


def available():
    """Whether the installed transformers has the Trainer this module drives."""
    try:
        from transformers import Trainer, TrainingArguments, trainer_pt_utils  # noqa: F401

        return hasattr(trainer_pt_utils, "EvalLoopContainer")
    except ImportError:
        return False


def _version():
    import transformers

    return transformers.__version__


def _rows_free(tensors):
    """``nested_numpify`` as the host sees it here: no rows (see the module's docstring)."""
    if isinstance(tensors, (list, tuple)):
        return type(tensors)(_rows_free(t) for t in tensors)
    if isinstance(tensors, dict):
        return type(tensors)({k: _rows_free(t) for k, t in tensors.items()})
    dtype = torch.float32 if tensors.dtype == torch.bfloat16 else tensors.dtype
    return np.zeros((0, *tensors.shape[1:]), dtype=torch.empty((), dtype=dtype).numpy().dtype)


class _Samples(torch.utils.data.Dataset):
    """``n`` samples whose values the collator makes: only the count matters here."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def evaluate(job, model, evaluation, precision, batch_size, floats, gpu, rec):
    """Runs ``Trainer.evaluate()`` on ``model`` (already on the stand-in GPU, as after
    training) for ``evaluation`` (the job document's: batches, accumulation_steps, logits) in
    batches of ``batch_size``; float inputs in ``floats``. Returns the Trainer's name and
    version, for the trace's header."""
    from transformers import PrinterCallback, Trainer, TrainingArguments, trainer_pt_utils
    from transformers.utils import logging as hf_logging

    def collate(samples):
        batch = [
            torch.zeros(shape, dtype=floats if dtype.is_floating_point else dtype)
            for shape, dtype in job.batch_specs(len(samples))
        ]
        return job.inputs(batch)

    half = precision in ("bf16", "amp-bf16"), precision in ("fp16", "amp-fp16")
    verbosity = hf_logging.get_verbosity()
    with (
        tempfile.TemporaryDirectory() as out,
        standin.cuda(gpu, rec),
        standin.patched(trainer_pt_utils, nested_numpify=_rows_free),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        hf_logging.set_verbosity_error()
        try:
            args = TrainingArguments(
                output_dir=out,
                per_device_eval_batch_size=batch_size,
                eval_accumulation_steps=evaluation.get("accumulation_steps"),
                bf16=half[0],
                fp16=half[1],
                include_for_metrics=["inputs"] if evaluation.get("inputs") else [],
                eval_do_concat_batches=not evaluation.get("as_list"),
                report_to=[],
                disable_tqdm=True,
                remove_unused_columns=False,
                log_level="error",
            )
            trainer = Trainer(
                model=model,
                args=args,
                eval_dataset=_Samples(evaluation["batches"] * batch_size),
                data_collator=collate,
                compute_metrics=(lambda prediction: {}) if evaluation.get("logits") else None,
            )
            trainer.remove_callback(PrinterCallback)  # its metrics are placeholders
            trainer.evaluate()
        finally:
            hf_logging.set_verbosity(verbosity)
    return f"transformers.Trainer {_version()}"
