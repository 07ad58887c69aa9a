"""DeepSpeed ZeRO (stages 1, 2 and 3) as its engine holds one rank's GPU memory, modelled on
``meta`` tensors from the config alone: DeepSpeed need not be installed (and cannot run on
``meta``). Each rule below is DeepSpeed's own (``deepspeed/runtime/zero/stage_1_and_2.py``,
``stage3.py``, ``partitioned_param_coordinator.py``); what is left out is named.

Every stage keeps the model in its 16-bit dtype (``bf16``/``fp16`` enabled; fp32 otherwise) and
gives the optimizer an fp32 master copy of this rank's partition, whose Adam moments it makes at
construction (a step with zero gradients). Gradients leave autograd as they are accumulated:
each is copied into a contiguous bucket of ``reduce_bucket_size`` elements (two with
``overlap_comm`` in stages 1–2), reduced when the bucket is full, and the rank keeps its
partition of it.

Stages 1 and 2: the 16-bit parameters are flattened into one buffer padded to a multiple of
2 × world size, partitioned in order; rank 0's gradients are those of the parameters that
overlap its partition, copied into ``grads_in_partition`` (stage 2, during backward; stage 1
keeps every gradient until backward ends, then reduces them). The step flattens the partition's
gradients, converts them to fp32, steps, and frees them; the updated weights are all-gathered
into the flat buffer in place.

Stage 3: each parameter is partitioned (``ceil(n / world)`` elements per rank) and gathered per
module for its forward and its backward — into a transient flat buffer, then one block per
parameter. Parameters of at most ``param_persistence_threshold`` elements stay gathered once
fetched. From the second step on (when DeepSpeed's parameter trace is complete) a module's
parameters are prefetched up to ``prefetch_bucket_size`` elements ahead (at most
``max_live_parameters`` gathered) and are kept, not released, when the trace reuses them within
``max_reuse_distance`` elements. The reduced gradient partitions live in a flat buffer made at
construction.

Offload: ``offload_optimizer`` keeps the master weights, moments and fp32 gradients on the host
(stages 1–2 keep a staging buffer of the largest parameter's size on the GPU);
``offload_param`` (stage 3) keeps the 16-bit partitions there. Not modelled: the reduce-scatter's
own scratch beyond one bucket, quantized or hierarchical collectives (ZeRO++), NVMe swapping
buffers, and NCCL's buffers (outside PyTorch's allocator).
"""

import itertools
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from .device import DEVICE, to_device_keeping_ties
from .models import ReferenceError_
from .tracer import storage_key


@dataclass
class ZeroConfig:
    """``zero_optimization`` of a DeepSpeed config, with DeepSpeed's defaults."""

    stage: int
    world_size: int
    reduce_bucket_size: int = 500_000_000
    overlap_comm: bool = None  # DeepSpeed: True for stage 3, else False
    contiguous_gradients: bool = True
    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    param_persistence_threshold: int = 100_000
    offload_optimizer: bool = False
    offload_param: bool = False


# Optimizer states per master element (fp32 tensors of the partition's size).
_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd-momentum": 1}


def largest_layer_parameters(model):
    """DeepSpeed's ``model_to_params``: the most parameters one module holds directly."""
    return max(
        (sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0
    )


def _empty(numel, dtype, rec, category, op):
    """The engine's own buffer: sized from the parameters and the config, never the batch; an
    allocation that launches no kernel."""
    rec.category, kernels = category, rec.kernels
    rec.kernels = False
    try:
        with rec.parameter_sized(op):
            return torch.empty(int(numel), dtype=dtype, device=DEVICE)
    finally:
        rec.category, rec.kernels = None, kernels


class Engine:
    """One rank's ZeRO engine: made in the loop's setup phase, it stands in for the optimizer
    (``zero_grad``, ``backward_start``/``backward_end`` around ``loss.backward()``, ``step``)."""

    def __init__(self, model, cfg, optimizer, dtype, rec):
        # DeepSpeed runs its own kernels whatever torch implementation the job names.
        optimizer = optimizer.removesuffix("-for-loop").removesuffix("-fused")
        if optimizer not in _STATES:
            raise ReferenceError_(
                f"ZeRO runs its own optimizer partitions; `{optimizer}` is not modelled with it (adam, adamw, sgd, sgd-momentum)"
            )
        self.cfg, self.rec, self.model, self.dtype = cfg, rec, model, dtype
        self.world = cfg.world_size
        self.overlap = cfg.overlap_comm if cfg.overlap_comm is not None else cfg.stage == 3
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.states = _STATES[optimizer]
        self.bucket = []  # the contiguous gradient buffers (stages 1-2: per backward)
        self.bucket_used = 0
        self.pending = []  # gradients waiting in the bucket (not contiguous): freed at its reduction
        self.partition_grads = None  # this rank's reduced gradients (16-bit)
        self.accumulated = None  # the first micro-batch's partition gradients, until the step
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)
        if cfg.stage == 3:
            self._setup_stage3()
        else:
            self._setup_stage12()

    # -- construction ------------------------------------------------------------------------

    def _master_and_states(self, numel):
        """The fp32 master partition and the optimizer's moments (made at construction by a
        step on a zero gradient, which is then freed)."""
        if self.cfg.offload_optimizer:
            return
        self.master = _empty(
            numel, torch.float32, self.rec, "optimizer_state", "zero_fp32_partition"
        )
        grad = _empty(numel, torch.float32, self.rec, "gradient", "zero_init_grad")
        self.moments = [
            _empty(numel, torch.float32, self.rec, "optimizer_state", "zero_optimizer_state")
            for _ in range(self.states)
        ]
        del grad

    def _setup_stage12(self):
        to_device_keeping_ties(self.model, self.dtype)
        total = sum(p.numel() for p in self.params)
        align = 2 * self.world
        padded = -(-total // align) * align
        self.partition = padded // self.world
        # Flattened on the GPU while the parameters still exist; they become views of it.
        flat = _empty(padded, self.dtype, self.rec, "parameter", "zero_flatten")
        offset, self.in_partition = 0, []
        for p in self.params:
            n = p.numel()
            if offset < self.partition:
                self.in_partition.append(p)
            p.data = flat.narrow(0, offset, n).view_as(p)
            offset += n
        self.flat = flat
        self.partition_numel = sum(p.numel() for p in self.in_partition)
        self._master_and_states(self.partition)
        if self.cfg.offload_optimizer:
            self.staging = _empty(
                max(p.numel() for p in self.params),
                self.dtype,
                self.rec,
                "gradient",
                "zero_offload_staging",
            )

    def _setup_stage3(self):
        # The model is on the device untracked (the loop moved it: zero.Init never puts the
        # whole model on the GPU); what is tracked is each rank's share, and the gathered
        # copies. Buffers are not partitioned: they are on the GPU whole.
        self.rec.untracked.update(storage_key(p) for p in self.model.parameters())
        for m in self.model.modules():
            for name, b in m._buffers.items():
                if b is not None:
                    m._buffers[name] = b.clone()
        self.partition = sum(self._shard(p) for p in self.params)
        if not self.cfg.offload_param:
            self.flat = _empty(self.partition, self.dtype, self.rec, "parameter", "zero3_partition")
        self._master_and_states(self.partition)
        if self.cfg.contiguous_gradients:
            self.bucket = [
                _empty(
                    self.cfg.reduce_bucket_size, self.dtype, self.rec, "gradient", "zero_ipg_bucket"
                )
            ]
        if not self.cfg.offload_optimizer:
            self.partition_grads = _empty(
                self.partition, self.dtype, self.rec, "gradient", "zero3_grad_partitions"
            )
        self.gathered = {}  # id(param) -> its gathered block
        self.live = 0  # elements gathered
        self.reused = {}  # step -> ids of the parameters the trace uses within max_reuse_distance
        self.modules = [
            m for m in self.model.modules() if any(True for _ in m.parameters(recurse=False))
        ]
        # Each module's own parameters, asked for at every fetch and release (and, by the
        # release, for each module ahead in the trace).
        self.own = {id(m): list(m.parameters(recurse=False)) for m in self.modules}
        self.order, self.trace, self.step_id = [], None, 0
        for m in self.modules:
            m.register_forward_pre_hook(self._pre_forward)
            m.register_forward_hook(self._post_forward)

    # -- stage 3: gathering ------------------------------------------------------------------

    def _own(self, m):
        return self.own[id(m)]  # every module fetched or released is one of self.modules

    def _shard(self, p):
        """A rank's elements of ``p`` (padded to a multiple of the world size)."""
        return -(-p.numel() // self.world)

    def _fetch(self, m):
        """All-gathers the module's missing parameters, then prefetches along the trace."""
        if self.trace is None:
            self.order.append(m)
        self._gather([p for p in self._own(m) if id(p) not in self.gathered])
        if self.trace is not None:
            self._prefetch()
        self.step_id += 1

    def _gather(self, params):
        if not params:
            return
        flat = _empty(
            sum(self._shard(p) for p in params) * self.world,
            self.dtype,
            self.rec,
            "temporary",
            "zero3_all_gather",
        )
        for p in params:
            self.gathered[id(p)] = (
                p,
                _empty(p.numel(), self.dtype, self.rec, "parameter", "zero3_gathered"),
            )
            self.live += p.numel()
        del flat

    def _prefetch(self):
        budget = min(self.cfg.max_live_parameters - self.live, self.cfg.prefetch_bucket_size)
        fetched, todo, chosen = 0, [], set()  # DeepSpeed skips what is already gathered
        for m in itertools.islice(self.trace, self.step_id + 1, None):
            if fetched >= budget:
                break
            for p in self._own(m):
                if id(p) not in self.gathered and id(p) not in chosen:
                    todo.append(p)
                    chosen.add(id(p))
                    fetched += p.numel()
        self._gather(todo)

    def _reused(self):
        """DeepSpeed's __params_to_release: a parameter the trace uses again within
        max_reuse_distance elements of this step stays gathered (the same every step: kept)."""
        if self.trace is None:
            return ()
        keep = self.reused.get(self.step_id)
        if keep is None:
            keep, traversed = set(), 0
            for later in itertools.islice(self.trace, self.step_id, None):
                if traversed >= self.cfg.max_reuse_distance:
                    break
                for p in self._own(later):
                    keep.add(id(p))
                    traversed += p.numel()
            self.reused[self.step_id] = keep
        return keep

    def _release(self, m):
        keep = self._reused()
        for p in self._own(m):
            if (
                p.numel() > self.cfg.param_persistence_threshold
                and id(p) not in keep
                and id(p) in self.gathered
            ):
                del self.gathered[id(p)]
                self.live -= p.numel()

    def _pre_forward(self, m, args):
        self._fetch(m)
        return _mark(args, lambda: self._release(m))

    def _post_forward(self, m, args, out):
        self._release(m)
        return _mark(out, lambda: self._fetch(m))

    def consolidated_16bit_state_dict(self):
        """DeepSpeed's ``_zero3_consolidated_16bit_state_dict`` (the model's save with
        ``stage3_gather_16bit_weights_on_model_save``): module by module, its own parameters
        all-gathered (``GatheredParameters``), copied to the host on rank 0, and partitioned
        again. Stages 1 and 2 hold the whole 16-bit model already: their state dict adds
        nothing on the GPU."""
        if self.cfg.stage != 3:
            return
        for m in self.modules:
            missing = [p for p in self._own(m) if id(p) not in self.gathered]
            self._gather(missing)
            for p in missing:  # `.cpu()` of each is the host's; the gathered blocks go
                del self.gathered[id(p)]
                self.live -= p.numel()

    # -- gradients ---------------------------------------------------------------------------

    def backward_start(self):
        if self.cfg.stage != 3 and self.cfg.contiguous_gradients:
            n = 2 if self.overlap else 1
            self.bucket = [
                _empty(
                    self.cfg.reduce_bucket_size, self.dtype, self.rec, "gradient", "zero_ipg_bucket"
                )
                for _ in range(n)
            ]
            self.bucket_used = 0

    def _on_grad(self, p):
        if self.cfg.stage == 1 and not self.overlap:
            return  # stage 1 reduces after backward
        self._to_bucket(p)

    def _to_bucket(self, p):
        n, size = p.numel(), self.cfg.reduce_bucket_size
        if self.bucket_used + n > size:
            self._reduce()
        self.bucket_used += n
        if self.cfg.contiguous_gradients and self.bucket and n <= size:
            self.bucket[0].narrow(0, 0, n).copy_(p.grad.view(-1))
            p.grad = None
        else:
            self.pending.append(p)
            if n > size:
                self._reduce()  # a parameter larger than the bucket is reduced on its own

    def _reduce(self):
        """The bucket's reduction: the rank keeps its partition of the gradients."""
        if self.cfg.stage == 2 and self.partition_grads is None and not self.cfg.offload_optimizer:
            self.partition_grads = _empty(
                self.partition_numel, self.dtype, self.rec, "gradient", "zero_grads_in_partition"
            )
        if self.cfg.stage == 3 and self.bucket_used:
            # reduce_scatter_coalesced flattens the bucket's gradients into one scratch buffer.
            _empty(self.bucket_used, self.dtype, self.rec, "temporary", "zero3_reduce_scatter")
        for p in self.pending:
            p.grad = None
        self.pending, self.bucket_used = [], 0

    def backward_end(self):
        if self.cfg.stage == 1 and not self.overlap:
            for p in self.params:
                if p.grad is not None:
                    self._to_bucket(p)
        self._reduce()
        if self.cfg.stage == 3:
            self.gathered = {
                k: v
                for k, v in self.gathered.items()
                if v[0].numel() <= self.cfg.param_persistence_threshold
            }
            self.live = sum(p.numel() for p, _ in self.gathered.values())
            if self.trace is None:
                self.trace = self.order
            self.step_id = 0
            return
        self.bucket = []  # stages 1-2 free their buckets at the end of backward
        if self.cfg.stage == 1 and not self.cfg.offload_optimizer:
            # The partition's averaged gradients, in the 16-bit dtype.
            self.partition_grads = _empty(
                self.partition_numel, self.dtype, self.rec, "gradient", "zero_grads_in_partition"
            )
        if self.accumulated is None:
            self.accumulated = self.partition_grads
        self.partition_grads = None

    def load_checkpoint(self):
        """DeepSpeed's ``load_checkpoint`` at resume, for this rank (the checkpoint read with
        ``map_location="cpu"``): the base optimizer's ``load_state_dict`` puts each state tensor
        of the partition on the GPU beside the live one (made at construction), and the old ones
        die when the state is replaced; the fp32 master partition (and stage 3's 16-bit one) is
        copied into in place, and the module's weights too. Offloaded, the state is the host's."""
        if self.cfg.offload_optimizer:
            return
        self.moments = [
            _empty(self.partition, torch.float32, self.rec, "optimizer_state", "zero_load_state")
            for _ in self.moments
        ]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        if self.cfg.offload_optimizer:
            self.accumulated = None
            return
        flat = _empty(self.partition, self.dtype, self.rec, "temporary", "zero_flatten_grads")
        fp32 = _empty(self.partition, torch.float32, self.rec, "gradient", "zero_fp32_grads")
        del flat
        if self.cfg.stage != 3:
            self.accumulated = None
        del fp32


class _Marker(torch.autograd.Function):
    """Identity in forward; runs ``callback`` when backward reaches these tensors."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def _mark(tree, callback):
    """``tree`` with its tensors that need gradients passed through a ``_Marker``."""
    leaves, spec = pytree.tree_flatten(tree)
    idx = [
        i
        for i, t in enumerate(leaves)
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
    ]
    if not idx:
        return None
    marked = _Marker.apply(callback, *(leaves[i] for i in idx))
    for i, t in zip(idx, marked):
        leaves[i] = t
    return pytree.tree_unflatten(leaves, spec)
