"""Losses as trainers compute them where that is not the model's own loss.

torchtune's chunked cross-entropy (``--chunked-ce N``): the model's output projection runs on N
slices of the sequence, returning a list of logits (torchtune's ``TransformerDecoder`` with
``set_num_output_chunks``), and ``CEWithChunkedOutputLoss`` upcasts one slice at a time to fp32
for its cross-entropy, so the whole sequence's fp32 logits never exist at once. The recipe shifts
the labels by one token itself (``torch.hstack`` with a column of ignored labels), computes the
loss, and drops the logits before backward.

On a Hugging Face causal language model the same happens by running the model without labels
with its output projection answering per slice. Where torchtune is installed its own loss class
is used; elsewhere a restatement of torchtune 0.6.1's (the allocations are the same, checked in
tests/test_titan.py's environment where torchtune installs).
"""

import importlib

import torch
import torch.nn.functional as F

from .models import Job, ReferenceError_, _mask

IGNORE_INDEX = -100  # torchtune's, and PyTorch's cross_entropy default


class ChunkedCrossEntropy(torch.nn.Module):
    """torchtune 0.6.1's ``CEWithChunkedOutputLoss``, restated: the sum of each slice's
    cross-entropy on its logits cast to fp32, over the count of labels not ignored."""

    def __init__(self, num_output_chunks=8, ignore_index=IGNORE_INDEX):
        super().__init__()
        self.num_output_chunks = num_output_chunks
        self.ignore_index = ignore_index

    def compute_cross_entropy(self, logits, labels):
        """One slice's summed cross-entropy: what torchtune's ``compile_loss`` compiles."""
        return F.cross_entropy(
            logits.float(), labels, ignore_index=self.ignore_index, reduction="sum"
        )

    def forward(self, logits, labels):
        counted = (labels != self.ignore_index).sum()
        # Every slice's labels and logits flattened first (a slice of the labels along the
        # sequence is not contiguous: each is copied), then one cross-entropy at a time.
        targets = [t.reshape(-1) for t in labels.chunk(self.num_output_chunks, dim=1)]
        flat = [part.reshape(-1, part.size(-1)) for part in logits]
        total = 0.0
        for part, target in zip(flat, targets):
            total += self.compute_cross_entropy(part, target)
        return total / counted


def loss_class():
    """torchtune's own loss class where torchtune imports, else the restatement."""
    try:
        return importlib.import_module("torchtune.modules.loss").CEWithChunkedOutputLoss
    except ImportError:
        return ChunkedCrossEntropy


def chunked_output(job, model, chunks, ref):
    """``job`` trained with torchtune's chunked cross-entropy over ``chunks`` slices."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not type(model).__name__.endswith("ForCausalLM"):
        raise ReferenceError_(
            f"{ref}: --chunked-ce applies to Hugging Face causal language models (…ForCausalLM), "
            "whose output projection it runs per slice"
        )
    whole = head.forward
    head.forward = lambda h: [whole(part) for part in h.chunk(chunks, dim=1)]
    loss_fn = loss_class()(num_output_chunks=chunks)

    def compile_loss(torch_compile):
        # torchtune's recipes: `compile: True` compiles each slice's upcast and cross-entropy.
        with torch_compile():
            try:
                importlib.import_module("torchtune.training").compile_loss(loss_fn, verbose=False)
            except ImportError:
                loss_fn.compute_cross_entropy = torch.compile(loss_fn.compute_cross_entropy)

    ignored = {}  # the recipe's ignore_labels_cache: one column per sample, made once

    def forward(m, b):
        try:
            out = m(input_ids=b[0], **_mask(b, 2))
        except TypeError as e:  # a list where the forward goes on with one tensor
            raise ReferenceError_(
                f"{ref}: --chunked-ce: the model's forward transforms its logits after the output "
                f"projection ({e}), so they cannot be taken per slice"
            ) from e
        if not isinstance(out.logits, list):
            raise ReferenceError_(
                f"{ref}: --chunked-ce: the model's forward transforms its logits after the output "
                "projection, so they cannot be taken per slice"
            )
        return out

    def loss(out, b):
        labels = b[1]
        if "column" not in ignored:
            ignored["column"] = torch.full(
                (labels.shape[0], 1), IGNORE_INDEX, dtype=labels.dtype, device=labels.device
            )
        shifted = torch.hstack((labels[..., 1:], ignored["column"][: labels.shape[0]]))
        return loss_fn(out.logits, shifted)

    return Job(
        model,
        job.batch_specs,
        loss,
        forward=forward,
        seq_len=job.seq_len,
        input_shape=job.input_shape,
        keeps_outputs=False,  # the recipe's `del logits` before backward
        specs_at=job.specs_at,
        compile_loss=compile_loss,
    )


def reference_logps(job, reference, batch, autocast):
    """TRL's scoring of a batch by its KL reference (``_get_per_token_logps``, under
    ``torch.no_grad()``, before the step): the reference's logits over the batch's tokens (no
    labels: no loss of its own), then ``selective_log_softmax`` gathered at those tokens — for
    16-bit logits one row's log-softmax at a time, for fp32 ones the gathered logits less each
    row's logsumexp — leaving one log-probability per token, which the step's loss reads.
    TRL's GRPO asks for the completion's logits only (``logits_to_keep``); these are the whole
    sequence's, an upper bound there. ``autocast``: the context the forward runs in (accelerate
    wraps a prepared model's forward in the job's autocast; the log-softmax runs outside it)."""
    if job.inputs is None:
        raise ReferenceError_("--reference-model scores Hugging Face language models")
    inputs = {k: v for k, v in job.inputs(batch).items() if k != "labels"}
    index = batch[1]
    with torch.no_grad():
        with autocast:
            logits = getattr(reference(**inputs), "logits", None)
        if logits is None or logits.dim() != 3 or index.shape != logits.shape[:2]:
            raise ReferenceError_(
                "--reference-model scores causal language models (logits per token)"
            )
        if logits.dtype in (torch.float32, torch.float64):
            picked = torch.gather(logits, -1, index.unsqueeze(-1)).squeeze(-1)
            return picked - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        rows = [
            F.log_softmax(row, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
            for row, ids in zip(logits, index)
        ]
        return torch.stack(rows)
