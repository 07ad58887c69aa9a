"""``torch.nn.DataParallel`` as its first GPU sees it.

DataParallel keeps the model, its gradients and the optimizer on GPU 0 and, every step:
scatters the batch (GPU 0's chunk is a view), replicates the parameters (GPU 0's replica *is* the
model: ``comm.broadcast_coalesced`` returns the source tensors for the source device, flattening
groups of small tensors into temporary buffers to send them), runs each replica on its chunk,
gathers every output tensor onto GPU 0 (full-batch copies; scalar losses become a vector), and in
backward holds every replica gradient until the ``Broadcast`` node runs, then sums them into new
buffers on GPU 0 (``reduce_add_coalesced``: flat groups of at most 10 MiB, NCCL reduce into an
``empty_like`` result) that become the ``.grad``s. GPU 0 carries the most memory, so a trace of
GPU 0 is the job's per-GPU peak. Sources: torch/nn/parallel/{data_parallel,replicate,
scatter_gather,_functions,comm}.py and torch/csrc/cuda/comm.cpp.
"""

from collections import OrderedDict

import torch
from torch.func import functional_call

COALESCE_BYTES = 10 * 1024 * 1024  # comm.broadcast_coalesced / reduce_add_coalesced buffer_size


def take_tensors(tensors, limit=COALESCE_BYTES):
    """torch._utils._take_tensors: groups of one dtype, each under ``limit`` bytes unless a
    single tensor is larger."""
    groups = OrderedDict()
    for t in tensors:
        size = t.numel() * t.element_size()
        group = groups.setdefault(t.dtype, [[], 0])
        if group[1] + size > limit and group[1] > 0:
            yield group[0]
            group = groups[t.dtype] = [[], 0]
        group[0].append(t)
        group[1] += size
    for group, _ in groups.values():
        if group:
            yield group


def flatten(group):
    """torch._utils._flatten_dense_tensors: one tensor is only reshaped; several are copied."""
    if len(group) == 1:
        return group[0].contiguous().view(-1)
    return torch.cat([t.contiguous().view(-1) for t in group])


def broadcast_temporaries(tensors):
    """The flat send buffers broadcast_coalesced makes on GPU 0, each freed after its group."""
    for group in take_tensors(tensors):
        flat = flatten(group)
        del flat


class Replicate(torch.autograd.Function):
    """GPU 0's side of ``Broadcast``: the replica's parameters alias the model's; their
    gradients wait in this node's input buffer until backward reaches it, then are reduced."""

    @staticmethod
    def forward(ctx, *params):
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        reduced = {}
        for group in take_tensors(grads):
            flat = flatten(group)
            result = torch.empty_like(flat)  # nccl.reduce's output on the destination
            result.copy_(flat)
            del flat
            offset = 0
            for g in group:
                reduced[id(g)] = result.narrow(0, offset, g.numel()).view_as(g)
                offset += g.numel()
        # Groups are per dtype; hand the results back in the parameters' order.
        return tuple(reduced[id(g)] for g in grads)


class Gather(torch.autograd.Function):
    """``Gather`` to GPU 0: a full-batch tensor holding every replica's part; its gradient
    goes back to GPU 0's replica as a view (``Scatter`` of the device's own chunk)."""

    @staticmethod
    def forward(ctx, t, total, scalar):
        ctx.rows, ctx.scalar = (1 if scalar else t.shape[0]), scalar
        part = t.view(1) if scalar else t
        full = part.new_empty((total,) + tuple(part.shape[1:]))
        full.narrow(0, 0, ctx.rows).copy_(part)
        return full

    @staticmethod
    def backward(ctx, g):
        part = g.narrow(0, 0, ctx.rows)
        return (part.view(()) if ctx.scalar else part), None, None


class DataParallel:
    """Runs ``forward(replica, chunk)`` as DataParallel over ``devices`` GPUs would on GPU 0."""

    def __init__(self, model, devices):
        self.model = model
        self.devices = devices

    def chunk_rows(self, batch_rows):
        """Rows of GPU 0's chunk and how many GPUs get one (``Tensor.chunk`` sizes)."""
        rows = -(-batch_rows // self.devices)
        return rows, -(-batch_rows // rows)

    def __call__(self, forward, batch):
        rows, used = self.chunk_rows(batch[0].shape[0])
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        broadcast_temporaries([p for _, p in named])
        broadcast_temporaries([b for b in self.model.buffers()])
        aliases = Replicate.apply(*[p for _, p in named])
        params = {n: a for (n, _), a in zip(named, aliases)}
        model = self.model

        def replica(*args, **kwargs):
            return functional_call(model, params, args, kwargs)

        chunk = [t.narrow(0, 0, min(rows, t.shape[0])) if t.dim() > 0 else t for t in batch]
        out = forward(replica, chunk)
        return self.gather(out, rows, used, batch[0].shape[0])

    def gather(self, out, rows, used, batch_rows):
        """Concatenates every replica's output on GPU 0: a tensor with the chunk's rows becomes
        the whole batch's; any other has one copy per replica."""
        if isinstance(out, torch.Tensor):
            scalar = out.dim() == 0
            total = (
                used if scalar else (batch_rows if out.shape[0] == rows else out.shape[0] * used)
            )
            return Gather.apply(out, total, scalar)
        if isinstance(out, dict):  # ModelOutput too
            items = {k: self.gather(v, rows, used, batch_rows) for k, v in out.items()}
            try:
                return type(out)(**items)
            except TypeError:
                return items
        if isinstance(out, (tuple, list)):
            vals = [self.gather(v, rows, used, batch_rows) for v in out]
            return type(out)(*vals) if hasattr(out, "_fields") else type(out)(vals)
        if out is not None and hasattr(out, "__iter__") and not isinstance(out, (str, bytes)):
            # Hugging Face Cache objects: DataParallel gathers each layer's keys and values.
            return [self.gather(v, rows, used, batch_rows) for v in out]
        return out
