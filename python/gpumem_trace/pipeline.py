"""One rank of pipeline parallelism: the stages of the model it holds, and its schedule's order of
forward and backward micro-batches, run on ``meta`` tensors.

The model's repeated blocks are cut into ``stages × virtual_stages`` consecutive chunks, as
torchtitan's ``pipeline_module_split`` cuts them (evenly by layer count, the embedding with the
first chunk, the final norm, head and loss with the last); rank ``k`` holds chunks
``k, k + stages, …`` (the looped placement of PyTorch's interleaved schedules). Only its chunks'
weights reach its GPU.

The order of actions is the schedule's own: GPipe (every forward, then every backward) and 1F1B
(``min(M, stages − k)`` forwards in flight, then one backward per forward) as PyTorch's
``ScheduleGPipe`` and ``Schedule1F1B`` step them; interleaved 1F1B and zero bubble from PyTorch's
own ``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble.pipeline_order``. Zero bubble
splits each backward as PyTorch's stage does, with PyTorch's own functions: the input's
gradients first (``stage_backward_input``, which keeps what the weights' need), the weights'
later (``stage_backward_weight``); the first stage, whose input needs none, runs its whole
backward at the weights' turn. What crosses between ranks is what PyTorch's
``PipelineStage`` allocates: one receive buffer per micro-batch for the activations (every
chunk but the first) and one for their gradients (every chunk but the last), made at the first
step and kept; a chunk's output and its inputs stay alive until that micro-batch's backward.
Sends and receives move no bytes here (the fake process group); the memory is where they land.
"""

import types

import torch

from . import distributed
from .models import ReferenceError_

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


def split_sizes(count, parts):
    """``count`` layers over ``parts`` chunks, the first chunks one larger where it does not
    divide (torchtitan's even split)."""
    return [count // parts + (1 if i < count % parts else 0) for i in range(parts)]


def actions(schedule, rank, stages, microbatches, virtual_stages):
    """Rank ``rank``'s actions in order: ``(kind, chunk, microbatch)``, kind ``F``, ``B`` or
    (zero bubble) ``I`` and ``W``, chunk the rank's own index (0 … virtual_stages − 1)."""
    n, m = stages, microbatches
    if schedule == "gpipe":
        return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(m, n - rank)
        out = [("F", 0, i) for i in range(warmup)]
        forward, backward = warmup, 0
        while True:
            out.append(("B", 0, backward))
            backward += 1
            if forward == m:
                break
            out.append(("F", 0, forward))
            forward += 1
        return out + [("B", 0, i) for i in range(backward, m)]
    from torch.distributed.pipelining import schedules

    # PyTorch's own order, from the schedule's rank-by-rank plan; it reads only each stage's
    # placement (the stages are stand-ins: nothing runs through them).
    placed = [
        types.SimpleNamespace(
            num_stages=n * virtual_stages,
            group_size=n,
            group_rank=rank,
            stage_index=rank + n * v,
            is_first=rank + n * v == 0,
            is_last=rank + n * v == n * virtual_stages - 1,
            submod=torch.nn.Module(),
        )
        for v in range(virtual_stages)
    ]
    order = {
        "interleaved-1f1b": schedules.ScheduleInterleaved1F1B,
        "zero-bubble": schedules.ScheduleInterleavedZeroBubble,
    }[schedule]
    plan = order(placed, m, loss_fn=lambda out, target: out)
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    out = []
    for a in plan.pipeline_order[rank]:
        if a is None:
            continue
        kind = kinds.get(a.computation_type.name)
        if kind is None:
            raise ReferenceError_(
                f"{schedule}: PyTorch's order has a {a} action gpumem does not run"
            )
        out.append((kind, (a.stage_index - rank) // n, a.microbatch_index))
    return out


class Chunk(torch.nn.Module):
    """A consecutive run of a Hugging Face decoder's layers: the embedding before them where it
    is the first chunk, the final norm, head and the model's loss after them where it is the
    last (torchtitan's split keeps the same; the rotary table is every chunk's)."""

    def __init__(self, model, layers, first, last, tensor_mesh=None):
        super().__init__()
        # With tensor parallelism, what crosses between stages is each rank's sequence shard
        # (sequence parallelism's residual stream), sent as a plain tensor (torchtitan's).
        self.tensor_mesh = tensor_mesh
        self.first, self.last = first, last
        base = model.base_model
        self.embed = base.get_input_embeddings() if first else None
        self.layers = torch.nn.ModuleList(layers)
        self.rotary = getattr(base, "rotary_emb", None)
        self.norm = base.norm if last else None
        self.head = model.get_output_embeddings() if last else None
        # Functions, not modules: the whole model must not become a submodule.
        self._loss = (model.loss_function, model.config.vocab_size) if last else None

    def forward(self, x, labels=None):
        if self.embed is not None:
            h = self.embed(x)
        elif self.tensor_mesh is not None:
            from torch.distributed.tensor import DTensor, Shard

            h = DTensor.from_local(x, self.tensor_mesh, [Shard(1)], run_check=False)
        else:
            h = x
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rotary = self.rotary(h, position_ids) if self.rotary is not None else None
        for layer in self.layers:
            h = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=rotary)
            if isinstance(h, tuple):  # older transformers return (hidden_states, …)
                h = h[0]
        if self._loss is None:
            return h.to_local() if self.tensor_mesh is not None else h
        loss, vocab = self._loss
        return loss(logits=self.head(self.norm(h)), labels=labels, vocab_size=vocab)


class TitanChunk(torch.nn.Module):
    """One model part of a torchtitan model, as torchtitan's ``pipeline_module_split`` makes it:
    a copy of the model keeping only its part's modules (the others ``None`` or emptied, which
    torchtitan's models' forward passes over), the job's own loss after the last."""

    def __init__(self, part, first, last, loss):
        super().__init__()
        self.part, self.first, self.last = part, first, last
        self._loss = loss if last else None

    def forward(self, x, labels=None, **kwargs):
        out = self.part(x, **kwargs)
        return out if self._loss is None else self._loss(out, labels)


def _titan_split(model, name, count, rank, stages, loss):
    """Rank ``rank``'s chunks of a torchtitan model: torchtitan's own module names per model
    part (``generate_llm_fqn_per_model_part`` with its default weights, the embedding and the
    norm and head each counting as a layer), each part a copy of the model's top module holding
    only those. The parts share the model's modules (torchtitan deep-copies the model before it
    parallelizes each part; here tensor parallelism and checkpointing already sit on the blocks,
    and a part holds the same blocks, parallelized the same way)."""
    import copy

    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    layers = model.layers
    if len(layers) + 2 < count:
        raise ReferenceError_(
            f"{name}: {len(layers)} layers do not fill {count} pipeline stages (stages x virtual stages)"
        )
    names = generate_llm_fqn_per_model_part(count, len(layers), 1, 1)
    chunks = []
    for s in range(rank, count, stages):
        keep = set(names[s])
        part = copy.copy(model)
        part._modules = dict(model._modules)
        part._parameters, part._buffers = dict(model._parameters), dict(model._buffers)
        for child, module in model.named_children():
            if isinstance(module, torch.nn.ModuleDict):
                held = {k: m for k, m in module.items() if f"{child}.{k}" in keep}
                part._modules[child] = torch.nn.ModuleDict(held)
            elif isinstance(module, torch.nn.ModuleList):
                held = [m for i, m in enumerate(module) if f"{child}.{i}" in keep]
                part._modules[child] = torch.nn.ModuleList(held)
            elif child not in keep:
                part._modules[child] = None
        chunks.append(TitanChunk(part, s == 0, s == count - 1, loss))
    return chunks


class Stages(torch.nn.Module):
    """The chunks one rank holds (its ``model``: only their weights are its)."""

    def __init__(self, chunks):
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)


def split(model, name, stages, virtual_stages, rank, tensor_mesh=None, loss=None):
    """Rank ``rank``'s chunks of a Hugging Face decoder, as ``Stages`` (``tensor_mesh``: the
    model's layers are tensor-parallel over it), or of a torchtitan model as torchtitan splits
    it (``loss(output, labels)``: the job's, after its last part); refused in one line for a
    model without a decoder's layers, norm and head, or with fewer layers than chunks."""
    if type(model).__module__.startswith("torchtitan.models."):
        return Stages(_titan_split(model, name, stages * virtual_stages, rank, stages, loss))
    base = getattr(model, "base_model", None)
    layers = getattr(base, "layers", None)
    if (
        not isinstance(layers, torch.nn.ModuleList)
        or getattr(base, "norm", None) is None
        or model.get_output_embeddings() is None
    ):
        raise ReferenceError_(
            f"{name}: pipeline parallelism splits a Hugging Face decoder (its base model's layers, norm and head); this model is not one"
        )
    count = stages * virtual_stages
    if len(layers) < count:
        raise ReferenceError_(
            f"{name}: {len(layers)} layers do not fill {count} pipeline stages (stages x virtual stages)"
        )
    sizes = split_sizes(len(layers), count)
    starts = [sum(sizes[:i]) for i in range(count)]
    chunks = []
    for v in range(virtual_stages):
        s = rank + stages * v
        held = list(layers)[starts[s] : starts[s] + sizes[s]]
        chunks.append(Chunk(model, held, s == 0, s == count - 1, tensor_mesh))
    return Stages(chunks)


class Schedule:
    """One training step of rank ``rank``'s chunks, micro-batch by micro-batch in the schedule's
    order. ``activation_dtype``: what flows between stages (the residual stream's: the weights'
    dtype)."""

    def __init__(self, stages, schedule, rank, count, microbatches, rec, activation_dtype):
        # Imported before the step is traced: its modules make tensors as they load
        # (microbatch.py's `torch.tensor(0.0)`), which only a process's first trace would see.
        import torch.distributed.pipelining.stage  # noqa: F401

        self.chunks = list(stages.chunks)
        self.order = actions(schedule, rank, count, microbatches, len(self.chunks))
        self.microbatches = microbatches
        self.rec = rec
        self.dtype = activation_dtype
        self.received = None  # per chunk, per micro-batch: (activations, gradients) buffers

    def _buffers(self, shape, device):
        """PyTorch's PipelineStage's receive buffers, made once at the first step."""
        with self.rec.labelled("activation"):
            self.received = [
                (
                    None
                    if c.first
                    else [
                        torch.empty(shape, dtype=self.dtype, device=device).requires_grad_(True)
                        for _ in range(self.microbatches)
                    ],
                    None
                    if c.last
                    else [
                        torch.empty(shape, dtype=self.dtype, device=device)
                        for _ in range(self.microbatches)
                    ],
                )
                for c in self.chunks
            ]

    def step(self, input_ids, hidden_size, sequence_shards=1, kwargs=None):
        """Every micro-batch of ``input_ids`` (the rank's batch: the labels too) through the
        rank's chunks, forward and backward in the schedule's order; ``kwargs`` (context
        parallelism's positions) split into micro-batches as the inputs are and given to every
        chunk, as PyTorch's schedules give a step's keyword arguments to every stage. Each
        backward runs through PyTorch's own ``backward_maybe_with_nosync`` (an FSDP chunk's gradients accumulate
        unsharded, its layers stay gathered, until its last micro-batch), and each chunk's
        gradients are reduced right after that, as PyTorch's schedules do."""
        if input_ids.shape[0] % self.microbatches:
            raise ReferenceError_(
                f"a batch of {input_ids.shape[0]} does not split into {self.microbatches} equal micro-batches"
            )
        ids = input_ids.tensor_split(self.microbatches)
        split = {k: v.tensor_split(self.microbatches) for k, v in (kwargs or {}).items()}
        kw = [{k: v[m] for k, v in split.items()} for m in range(self.microbatches)]
        if self.received is None:
            batch, seq = ids[0].shape
            self._buffers((batch, seq // sequence_shards, hidden_size), input_ids.device)
        stages = [_stage(c, self.microbatches) for c in self.chunks]
        # Each chunk's last backward action (a B, or a W: zero bubble's weights, or the first
        # chunk's whole deferred backward), where PyTorch's stage passes ``last_backward``.
        last = {c: i for i, (kind, c, _) in enumerate(self.order) if kind in "BW"}
        cache, weights_later = {}, {}
        for i, (kind, c, m) in enumerate(self.order):
            chunk, stage, (acts, grads) = self.chunks[c], stages[c], self.received[c]
            if kind == "F":
                self.rec.phase = "forward"
                _before_forward(chunk)
                x = ids[m] if acts is None else acts[m]
                cache[c, m] = (chunk(x, labels=ids[m], **kw[m]), x)
                continue
            self.rec.phase = "backward"
            final = i == last[c]
            if final:  # what earlier micro-batches accumulated (releases before 2.10 reduce in it)
                for grad in distributed.unreduced_gradients(chunk):
                    self.rec.relabel(grad, "gradient")
            if kind == "W":
                later = weights_later.pop((c, m))
                if chunk.first:  # its whole backward, deferred to here (no input gradient)
                    out, grad = later
                    _backward(
                        stage, "full", final, stage_output=out, output_grads=grad, input_values=[]
                    )
                else:
                    _backward(stage, "weight", final, param_groups=later)
            else:
                out, x = cache.pop((c, m))
                # The loss (the last chunk's output), or the output and its received gradient.
                grad = None if grads is None else grads[m]
                inputs = [] if chunk.first else [x]
                if kind == "B":
                    _backward(
                        stage,
                        "full",
                        final,
                        stage_output=out,
                        output_grads=grad,
                        input_values=inputs,
                    )
                elif chunk.first:
                    weights_later[c, m] = (out, grad)
                else:
                    _, later = _backward(
                        stage,
                        "input",
                        final,
                        stage_output=[out],
                        output_grads=None if grad is None else [grad],
                        input_values=inputs,
                    )
                    weights_later[c, m] = later
                del out
            if final:
                self._reduce(stage)

    def _reduce(self, stage):
        """A chunk's gradients reduced right after its last backward action, where PyTorch's
        schedules put it (``_add_reduce_grad``; releases before 2.10 reduce inside that
        backward): an interleaved rank's later chunk frees its unsharded gradients before its
        earlier chunk's backwards are done."""
        for grad in distributed.unreduced_gradients(stage.submod):
            self.rec.relabel(grad, "gradient")
        if hasattr(stage, "perform_reduce_grad"):  # PyTorch 2.10 on: a step of its own
            stage.perform_reduce_grad(1)


def _backward(stage, how, last, **kwargs):
    """One backward action of ``stage``, as PyTorch's stage runs it (``how``: full, input or
    weight; ``last``: the chunk's last backward of the step)."""
    return stage.backward_maybe_with_nosync(how, kwargs, last_backward=last)


def _stage(chunk, microbatches):
    """What PyTorch's own pipeline stage methods read of a stage, for one chunk: its module (an
    FSDP root where FSDP shards it), the micro-batches, and its gradient reduction."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    class Stage(_PipelineStageBase):
        def __init__(self):  # not the base's, which makes communication buffers
            self.submod, self.chunks, self.has_backward = chunk, microbatches, True
            self._gradient_reduction_handle = None

    # Its abstract methods (communication set-up, which differs by release) are never called:
    # the order and the buffers are the Schedule's own.
    Stage.__abstractmethods__ = frozenset()
    return Stage()


def _before_forward(chunk):
    """What PyTorch's stage does to an FSDP chunk before its forward: from 2.15 on, the stage,
    not autograd, finalizes each backward (``set_manual_backward_finalization``)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(chunk, FSDPModule) and hasattr(chunk, "set_manual_backward_finalization"):
        chunk.set_manual_backward_finalization(True)
