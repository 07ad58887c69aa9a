"""One rank of a multi-GPU job, traced with PyTorch's own wrapper on ``meta`` tensors.

The job's process group is PyTorch's fake one (``torch.testing._internal.distributed.fake_pg``:
every collective completes at once, no data moves), so the wrapper allocates what it allocates on
a GPU — its buffers, its copies, in its order — and the trace is rank 0's. Collectives keep the
memory they would: in place on their inputs (all-reduce, broadcast) or into the outputs the
caller made (all-gather). What a real run adds outside PyTorch's allocator (NCCL's own buffers)
is not traced here.

DistributedDataParallel: the constructor broadcasts the module's state (flat coalesced copies)
and its reducer allocates the gradient buckets (``bucket_cap_mb``, a smaller first bucket,
rebuilt in gradient-ready order after the first step); in backward each gradient is copied into
its bucket, which is all-reduced and divided by the world size in place, and copied back
(``gradient_as_bucket_view``: the gradients are views of the buckets instead).
"""

import contextlib
import itertools
import re

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from .models import ReferenceError_

# c10d ops whose meta kernel answers (inputs, work) rather than work alone.
_RETURN_INPUTS = {
    "allgather_",
    "allreduce_",
    "broadcast_",
    "reduce_scatter_",
    "allgather_coalesced_",
    "allgather_into_tensor_coalesced_",
    "reduce_scatter_tensor_coalesced_",
}
_META_OPS = sorted(_RETURN_INPUTS | {"_allgather_base_", "_reduce_scatter_base_", "barrier"})
_library = None


def fake_world(world_size):
    """Joins a fake process group of ``world_size`` ranks as rank 0 (once per process), and
    teaches c10d's collectives to run on meta tensors: each calls the fake group with empty CPU
    stand-ins (nothing moves) and answers with the meta tensors the caller gave."""
    global _library
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ReferenceError_(
                f"one tracer process traces one world size ({dist.get_world_size()}), not {world_size}"
            )
        return
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:
        raise ReferenceError_(
            f"this torch has no fake process group to trace multi-GPU jobs with ({e})"
        ) from e
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    _library = torch.library.Library("c10d", "IMPL")
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for name in _META_OPS:
        op = getattr(torch.ops.c10d, name, None)
        # PyTorch's own (torch.distributed._tools.fake_collectives, which context
        # parallelism's modules import) answer the same way where they came first.
        if op is not None and not has(f"c10d::{name}", "Meta"):
            _library.impl(name, _on_meta(op.default, name in _RETURN_INPUTS), "Meta")


def _on_meta(op, returns_inputs):
    def run(*args, **kwargs):
        stand_in = pytree.tree_map(
            lambda t: torch.empty(0, dtype=t.dtype) if isinstance(t, torch.Tensor) else t,
            (args, kwargs),
        )
        out = op(*stand_in[0], **stand_in[1])
        return (args[0], out[1]) if returns_inputs else out

    return run


def _allreduce_in_place(on_bucket, bucket):
    """DDP's default communication as memory sees it: the bucket all-reduced and divided by the
    world size in place (the fake group's own future carries no tensor for DDP to go on with)."""
    on_bucket(bucket.buffer())
    future = torch.futures.Future()
    future.set_result(bucket.buffer().div_(dist.get_world_size()))
    return future


def ddp(
    model,
    world_size,
    bucket_cap_mb,
    gradient_as_bucket_view,
    on_bucket,
    rebuilding=contextlib.nullcontext,
):
    """``DistributedDataParallel(model)`` as rank 0 of ``world_size`` builds it; ``on_bucket``
    hears of each gradient bucket as it is reduced (its memory is gradients); the buckets'
    rebuild (in the second step's forward) runs inside ``rebuilding()``."""
    fake_world(world_size)
    # The constructor's check that every rank has the same shapes reads sizes back (.item()),
    # which meta tensors cannot; one traced rank is every rank.
    import torch.nn.parallel.distributed as ddp_module

    verify = ddp_module._verify_param_shape_across_processes
    ddp_module._verify_param_shape_across_processes = lambda *a, **k: None
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view
        )
    finally:
        ddp_module._verify_param_shape_across_processes = verify
    wrapped.register_comm_hook(on_bucket, _allreduce_in_place)
    wrapped.reducer = _Rebuilding(
        wrapped.reducer, rebuilding
    )  # after the hook: C++ takes the reducer itself
    return wrapped


class _Rebuilding:
    """DDP's reducer, its bucket rebuild inside ``rebuilding()``; DDP's Python only calls its
    methods once the comm hook is registered."""

    def __init__(self, reducer, rebuilding):
        self._reducer, self._rebuilding = reducer, rebuilding

    def __getattr__(self, name):
        return getattr(self._reducer, name)

    def _rebuild_buckets(self):
        with self._rebuilding():
            return self._reducer._rebuild_buckets()


class _MetaStream:
    """A CUDA stream and event where there is no device: everything runs in order, but each
    stream a ``_MetaDevice`` makes is its own (its id): what is allocated while it is current
    comes from its own pool of the caching allocator, as on a GPU. The default stream and
    events are id 0."""

    device_index = device_type = 0

    def __init__(self, *args, stream_id=0, **kwargs):
        self.stream_id = stream_id

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _MetaStream()

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _MetaDevice:
    """``torch.cuda`` as FSDP2 uses it, for the meta device: the current stream, which
    ``on_stream(id)`` hears of as FSDP2 enters and leaves its own (all-gather copy-in,
    reduce-scatter) streams."""

    Event = _MetaStream
    DEFAULT = _MetaStream()

    def __init__(self, on_stream):
        self.on_stream = on_stream
        self.current = [self.DEFAULT]
        # Numbered per traced job, so that traces of one job at two depths (made in one
        # process) name their streams alike.
        self.made = itertools.count(1)

    def Stream(self, *args, **kwargs):  # noqa: N802 (torch.cuda.Stream's name)
        return _MetaStream(stream_id=next(self.made))

    def current_stream(self, *args):
        return self.current[-1]

    @contextlib.contextmanager
    def stream(self, s):
        self.current.append(s if isinstance(s, _MetaStream) else self.DEFAULT)
        self.on_stream(self.current[-1].stream_id)
        try:
            yield
        finally:
            self.current.pop()
            self.on_stream(self.current[-1].stream_id)

    @staticmethod
    def current_device():
        return 0

    @staticmethod
    def synchronize(*args):
        pass


def _offload_on_meta(_fsdp_param, _fsdp_param_group):
    """FSDP2's CPU offload with the host's tensors on meta: its check that the shards are CPU
    tensors is waived, and a shard's copy to the GPU — which ``.to(device)`` skips when both
    sides are meta — is made (a new tensor, then the param dtype's cast)."""
    _fsdp_param_group.FSDPParamGroup._validate_cpu_offload_params = lambda self: None
    cls = _fsdp_param.FSDPParam
    if getattr(cls, "_gpumem_inputs", None) is not None:
        return
    cls._gpumem_inputs = real = cls.all_gather_inputs

    def all_gather_inputs(self):
        if (
            self.offload_to_cpu
            and self.sharded_state == _fsdp_param.ShardedState.SHARDED
            and not hasattr(self._sharded_local_tensor, "fsdp_pre_all_gather")
        ):
            return [
                _fsdp_param._to_dtype_if_needed(self._sharded_param_data.clone(), self.param_dtype)
            ]
        return real.fget(self)

    cls.all_gather_inputs = property(all_gather_inputs)


def broadcast_load(model, device):
    """The model's load from rank 0 onto a sharded model, as accelerate's
    ``fsdp2_load_full_state_dict`` does it (``cpu_ram_efficient_loading``; FSDP's
    ``sync_module_states`` broadcasts the same way): for each entry of the state dict in turn,
    rank 0 copies the whole tensor to its GPU and every other rank receives it into a whole
    tensor of its own, which ``distribute_tensor`` cuts to the rank's shard before the next
    arrives — one whole parameter (or buffer) at a time beside the shards, on every rank, even
    where the shards live on the host."""
    for t in model.state_dict().values():
        whole = torch.empty(t.shape, dtype=t.dtype, device=device)
        del whole


def device_mesh(world_size, replicas=1, tensor=1, pipeline=1, context=1):
    """The job's ranks as PyTorch's ``DeviceMesh`` on the fake group, rank 0's view, with the
    dimensions the job document names — ``pipeline``, ``replicate`` (HSDP's groups), ``shard``
    (FSDP's ranks), ``context`` and ``tensor`` — in torchtitan's order (pipeline outermost,
    tensor parallelism innermost: its ranks are one machine's). A dimension of degree 1 is
    there too; a job's wrapper takes the sub-mesh of its own dimensions."""
    if context > 1:
        # Context parallelism's modules bring PyTorch's own meta collectives in: first, so
        # that fake_world leaves those to them (they answer as its own do).
        with contextlib.suppress(ImportError):
            import torch.distributed._tools.fake_collectives  # noqa: F401
    fake_world(world_size)
    from torch.distributed.device_mesh import init_device_mesh

    shard = world_size // (pipeline * replicas * tensor * context)
    return init_device_mesh(
        "cpu",
        (pipeline, replicas, shard, context, tensor),
        mesh_dim_names=("pipeline", "replicate", "shard", "context", "tensor"),
    )


def expert_mesh(world_size, replicas=1, pipeline=1, expert=1):
    """The ranks as torchtitan's expert layers see them (``ParallelDims``' sparse mesh, with
    no tensor parallelism inside the experts): ``pipeline``, ``replicate``, ``efsdp`` and
    ``ep``, where expert parallelism borrows its ranks from FSDP's, context parallelism's and
    tensor parallelism's (``efsdp = shard × context × tensor / ep``): the experts are split
    over ``ep`` and what remains of FSDP shards them further."""
    fake_world(world_size)
    from torch.distributed.device_mesh import init_device_mesh

    efsdp = world_size // (pipeline * replicas * expert)
    return init_device_mesh(
        "cpu",
        (pipeline, replicas, efsdp, expert),
        mesh_dim_names=("pipeline", "replicate", "efsdp", "ep"),
    )


def expert_parallel(model, tensor_mesh, experts_mesh, name):
    """torchtitan's own ``apply_moe_ep_tp`` on its mixture-of-experts model: the routed
    experts split over ``experts_mesh["ep"]`` (each rank its ``E / ep`` experts, the tokens
    sent to them and back by all-to-all, ``ExpertParallel``) where it has more than one rank,
    and the MoE layers' tensor parallelism (router replicated, shared experts column/row-wise,
    tokens split over the tensor ranks) where ``tensor_mesh`` is given. Returns the routed
    experts' modules (FSDP shards them over ``efsdp``). Refused in one line for a model with
    no MoE layers or not torchtitan's."""
    import importlib
    import inspect

    layers = getattr(model, "layers", None)
    moe = [
        b
        for b in (layers.values() if layers is not None else ())
        if getattr(b, "moe_enabled", False)
    ]
    if not type(model).__module__.startswith("torchtitan.models.") or not moe:
        raise ReferenceError_(
            f"{name}: expert parallelism is traced with torchtitan's own code, on its mixture-of-experts models (torchtitan:qwen3, deepseek_v3, llama4)"
        )
    family = type(model).__module__.split(".")[2]
    parallelize = importlib.import_module(f"torchtitan.models.{family}.infra.parallelize")
    apply = getattr(parallelize, "apply_moe_ep_tp", None)
    if apply is None:
        raise ReferenceError_(
            f"{name}: torchtitan's {family} has no apply_moe_ep_tp gpumem can call"
        )
    ep = experts_mesh["ep"] if experts_mesh is not None and experts_mesh["ep"].size() > 1 else None
    # No tensor parallelism inside the experts (ETP = 1), in each family's spelling.
    given = dict(
        tp_mesh=tensor_mesh, ep_mesh=ep, etp_mesh=None, ep_etp_mesh=None, etp_enabled=False
    )
    params = inspect.signature(apply).parameters
    needed = [k for k, v in params.items() if k != "model" and v.default is inspect.Parameter.empty]
    if not set(needed) <= set(given):
        raise ReferenceError_(
            f"{name}: torchtitan's {family} apply_moe_ep_tp takes ({', '.join(params)}), not what gpumem gives"
        )
    apply(model, **{k: v for k, v in given.items() if k in params})
    return [b.moe.experts for b in moe] if ep is not None else []


def data_parallel_mesh(mesh):
    """FSDP's part of ``device_mesh``'s mesh: its ``shard`` ranks — with context parallelism,
    its ranks too, flattened into one dimension as torchtitan's ``dp_shard_cp`` — within
    ``replicate`` groups where there are more than one (HSDP)."""
    if mesh["context"].size() == 1:
        return mesh["replicate", "shard"] if mesh["replicate"].size() > 1 else mesh["shard"]
    flat = mesh["shard", "context"]._flatten("shard_context")
    return mesh["replicate", "shard_context"] if mesh["replicate"].size() > 1 else flat


def context_parallel(model, mesh, name):
    """torchtitan's own context parallelism on its model: ``apply_cp_to_attention_module`` on
    each block's attention (PyTorch's ``_ContextParallel``: queries, keys and values become
    sequence-sharded DTensors, whose attention kernel PyTorch answers with ring attention — the
    keys and values of the other ranks' chunks gathered, its ``rotate_method``'s default), and
    the batch's inputs and labels cut to the rank's chunks of the sequence (torchtitan's
    ``prepare_context_parallel_input``, head-tail load balancing, with the positions it passes
    the model). Returns that cut: ``(inputs, labels) -> (inputs, labels, model kwargs)``.
    Refused in one line for a model not torchtitan's."""
    if not type(model).__module__.startswith("torchtitan.models."):
        raise ReferenceError_(
            f"{name}: context parallelism is traced with torchtitan's own code, on its models (torchtitan:llama3, qwen3, llama4, deepseek_v3)"
        )
    from torchtitan.distributed.context_parallel import (
        apply_cp_to_attention_module,
        prepare_context_parallel_input,
    )

    attentions = [b.attention for b in model.layers.values()]
    kinds = {getattr(a, "attn_type", "sdpa") for a in attentions}
    if kinds != {"sdpa"}:
        raise ReferenceError_(
            f"{name}: context parallelism of {', '.join(sorted(kinds - {'sdpa'}))} attention is not traced (the loop builds no block mask): give the model attn_type=sdpa"
        )
    apply_cp_to_attention_module([a.inner_attention for a in attentions], mesh, "sdpa")
    return lambda inputs, labels: prepare_context_parallel_input(
        inputs, labels, {}, mesh, inputs.device, "headtail"
    )


# transformers' plan styles, as torchtitan lays them out with sequence parallelism.
_COLUMN, _ROW, _REPLICATED = "colwise", "rowwise", "replicated_with_grad_allreduce"


def tensor_parallel(model, mesh, name, context_parallel=False, sequence_parallel=True):
    """Tensor parallelism over ``mesh`` (1-D) as torchtitan applies it to a Llama-like decoder,
    on the layers the Hugging Face model's own plan (``config.base_model_tp_plan``) names
    column-wise and row-wise, with PyTorch's ``parallelize_module``:

    - each column-wise linear layer ``ColwiseParallel`` (its output features sharded: each rank
      computes its heads, its MLP columns), each row-wise one ``RowwiseParallel`` reduce-
      scattering its output over the sequence (``Shard(1)``), as torchtitan's plan does;
    - sequence parallelism: between blocks the residual stream is each rank's 1/N of the
      sequence, the blocks' norms and the final norm ``SequenceParallel``, and each attention
      and MLP all-gathers the sequence at its input (torchtitan's ``PrepareModuleInput``); a
      column-wise layer that is the block's own (BioGPT's and OPT's ``fc1``) gathers its input
      itself;
    - the input embedding row-wise (vocabulary sharded, output sharded over the sequence), the
      head column-wise with its logits gathered whole on every rank (transformers'
      ``colwise_gather_output``; torchtitan's loss parallelism, which keeps them sharded, is
      not modelled);
    - layers the plan replicates (``replicated_with_grad_allreduce``: Qwen3's per-head norms)
      stay whole on every rank; so do learned positions (BioGPT's, OPT's), whose output is cut
      to the rank's part of the sequence before it joins the stream.

    Without ``sequence_parallel`` (Megatron-LM without ``--sequence-parallel``): the stream, the
    norms and the positions stay whole on every rank, each column-wise layer takes that whole
    input as it is and each row-wise one all-reduces its output (PyTorch's default layouts),
    the embedding's output is all-reduced whole too.

    Refused in one line: a model without a plan, a plan style other than these, heads that do
    not divide over the ranks, a layer that is not a plain Linear (LoRA's).
    ``context_parallel``: the job's sequence is split too (torchtitan's plans are told)."""
    if type(model).__module__.startswith("torchtitan.models."):
        if not sequence_parallel:
            raise ReferenceError_(
                f"{name}: torchtitan's tensor parallelism is sequence-parallel; --no-sequence-parallel applies to Hugging Face models"
            )
        return _torchtitan_tensor_parallel(model, mesh, name, context_parallel)
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    base = getattr(model, "base_model", None)
    if not plan or base is None:
        raise ReferenceError_(
            f"{name}: tensor parallelism needs the model's tensor-parallel plan (a Hugging Face model's base_model_tp_plan); this model has none"
        )
    n = mesh.size()
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if heads is not None and heads % n:
            raise ReferenceError_(
                f"{name}: {key}={heads} does not divide over {n} tensor-parallel ranks"
            )
    patterns = [
        (re.compile(re.escape(k).replace(r"\*", r"[^.]+") + "$"), k, v) for k, v in plan.items()
    ]
    styles, gathers = {}, set()
    is_norm = lambda m: "Norm" in type(m).__name__
    modules = dict(base.named_modules())
    for path, module in base.named_modules():
        for pattern, key, style in patterns:
            if not pattern.match(path):
                continue
            if style == _REPLICATED:
                break
            if style not in (_COLUMN, _ROW):
                raise ReferenceError_(
                    f"{name}: tensor parallelism of `{style}` layers ({key}) is not modelled"
                )
            if type(module) is not torch.nn.Linear:
                raise ReferenceError_(
                    f"{name}: {path} is a {type(module).__name__}, not a Linear: tensor parallelism of it (LoRA's layers) is not modelled"
                )
            if style == _COLUMN and not sequence_parallel:
                styles[path] = ColwiseParallel()
            elif style == _COLUMN:
                parent = path.rpartition(".")[0]
                if any(is_norm(c) for c in modules[parent].children()):
                    # A block's own layer (BioGPT's, OPT's fc1): it gathers its input itself.
                    styles[path] = ColwiseParallel(input_layouts=Shard(1))
                else:
                    # An attention's or MLP's layers share one gathered input.
                    styles[path] = ColwiseParallel()
                    gathers.add(parent)
            elif not sequence_parallel:
                styles[path] = RowwiseParallel()
            else:
                styles[path] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
            break
    if not styles:
        raise ReferenceError_(f"{name}: its tensor-parallel plan names none of its layers")
    embedding = base.get_input_embeddings()
    if sequence_parallel:
        blocks = {g.rpartition(".")[0] for g in gathers}
        for block in blocks:
            for child, m in modules[block].named_children():
                if is_norm(m):
                    styles[f"{block}.{child}"] = SequenceParallel()
        for child, m in base.named_children():
            if is_norm(m):
                styles[child] = SequenceParallel(use_local_output=True)
        styles[_path_of(base, embedding)] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        )
    else:
        styles[_path_of(base, embedding)] = RowwiseParallel(input_layouts=Replicate())
    parallelize_module(base, mesh, styles)
    if sequence_parallel:
        for m in base.children():
            if isinstance(m, torch.nn.Embedding) and m is not embedding:
                _replicated(m, mesh, Shard(1))
        for path in gathers:
            modules[path].register_forward_pre_hook(_gathered, with_kwargs=True)
    else:
        # What the plan leaves whole (the norms, learned positions): replicated DTensors, as
        # every parameter of a tensor-parallel model is (the optimizer's foreach kernels take
        # no mix of the two).
        for path, m in base.named_modules():
            if path not in styles and next(m.parameters(recurse=False), None) is not None:
                _replicated(m, mesh)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        tied = head.weight is embedding.weight
        stream = Shard(1) if sequence_parallel else Replicate()
        parallelize_module(
            head, mesh, ColwiseParallel(input_layouts=stream, output_layouts=Replicate())
        )
        if tied:  # one parameter, sharded over the vocabulary for both
            head.weight = embedding.weight
    return model


def _replicated(module, mesh, placement=None):
    """A module the plan does not split, whole on every rank: its parameters replicated
    DTensors (as the norms' weights are under sequence parallelism), whatever it is given taken
    as replicated, its output redistributed to ``placement`` (learned positions joining the
    sequence-sharded stream: ``Shard(1)``) or, without one, handed on as the rank's tensor."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def replicated(x):
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            return DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return x

    distribute_module(module, mesh)
    module.register_forward_pre_hook(
        lambda _m, args, kwargs: (
            tuple(replicated(a) for a in args),
            {k: replicated(v) for k, v in kwargs.items()},
        ),
        with_kwargs=True,
    )
    module.register_forward_hook(
        lambda _m, _args, out: (
            out.to_local() if placement is None else out.redistribute(mesh, [placement])
        )
    )


def _torchtitan_tensor_parallel(model, mesh, name, context_parallel):
    """torchtitan's own tensor parallelism for its model (``torchtitan.models.FAMILY.infra.
    parallelize``'s ``apply_tp``, or ``apply_non_moe_tp`` for its mixture-of-experts families,
    whose MoE layers ``expert_parallel`` parallelizes), with its defaults: loss parallelism
    (the logits stay sharded over the vocabulary into the loss, which the caller runs under
    ``loss_parallel()``), no float8, no async TP; context parallelism as the job has it."""
    import importlib
    import inspect

    family = type(model).__module__.split(".")[2]
    parallelize = importlib.import_module(f"torchtitan.models.{family}.infra.parallelize")
    apply = getattr(parallelize, "apply_tp", None) or getattr(parallelize, "apply_non_moe_tp", None)
    if apply is None:
        raise ReferenceError_(f"{name}: torchtitan's {family} has no apply_tp gpumem can call")
    given = {
        "loss_parallel": True,
        "enable_float8_tensorwise_tp": False,
        "enable_async_tp": False,
        "cp_enabled": context_parallel,
    }
    params = list(inspect.signature(apply).parameters.values())[2:]
    needed = {p.name for p in params if p.default is inspect.Parameter.empty}
    if not needed <= set(given) or "loss_parallel" not in {p.name for p in params}:
        raise ReferenceError_(
            f"{name}: torchtitan's {family} {apply.__name__} takes ({', '.join(p.name for p in params)}), not the mesh and {', '.join(given)} gpumem gives"
        )
    apply(model, mesh, **{p.name: given[p.name] for p in params if p.name in given})
    return model


def loss_parallel(model):
    """The context the step runs in: PyTorch's ``loss_parallel()`` where the model's tensor
    parallelism keeps the logits sharded into the loss (torchtitan's), else nothing."""
    if type(model).__module__.startswith("torchtitan.models."):
        from torch.distributed.tensor.parallel import loss_parallel as parallel_loss

        return parallel_loss()
    return contextlib.nullcontext()


def _path_of(root, module):
    return next(p for p, m in root.named_modules() if m is module)


def _gathered(module, args, kwargs):
    """An attention's or MLP's input gathered over the sequence and handed on as the rank's
    local tensor (``PrepareModuleInput(Shard(1) -> Replicate(), use_local_output=True)``, for
    an input given by position or by name)."""
    from torch.distributed.tensor import DTensor, Replicate

    whole = lambda t: (
        t.redistribute(placements=[Replicate()]).to_local() if isinstance(t, DTensor) else t
    )
    return tuple(whole(a) for a in args), {k: whole(v) for k, v in kwargs.items()}


def fsdp(
    model,
    blocks,
    mesh,
    reshard_after_forward,
    on_alloc,
    on_free,
    on_stream=lambda stream_id: None,
    param_dtype=None,
    cpu_offload=False,
    experts=(),
    experts_mesh=None,
):
    """``fully_shard`` on each block, then on the model, as rank 0 of ``world_size`` (FSDP2),
    with ``MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=float32)`` where a
    ``param_dtype`` is given: layers are gathered and computed in it, gradients reduced into
    fp32 shards. ``cpu_offload``: ``CPUOffloadPolicy`` — the shards live on the host (the caller
    shards under ``Recorder.on_host``), each is copied to the GPU for its all-gather (the copies
    of a layer live until they are copied into its all-gather buffer, as FSDP2's
    ``all_gather_inputs`` makes them), gradients are reduce-scattered on the GPU and sent to the
    host; the optimizer steps there. Pinning is the host's business (``pin_memory`` needs a GPU
    here and changes nothing on it).
    ``mesh`` is ``data_parallel_mesh``'s: a 2-D one is HSDP, sharded along its second dimension
    and replicated along its first (gradients reduce-scattered in the group, then all-reduced
    across groups); parameters tensor parallelism made DTensors are sharded again over it.
    ``experts``: expert parallelism's routed experts, each sharded apart before its block over
    ``experts_mesh`` (``expert_mesh``'s ``efsdp`` ranks, within ``replicate`` groups), on their
    second dimension where ``efsdp × ep`` outnumbers the experts (torchtitan's ``apply_fsdp``).
    FSDP2 frees a layer's gathered parameters by resizing their storage to nothing and gathers
    them again into the same storage: ``on_free(tensor)`` and ``on_alloc(tensor)`` hear of each
    (a storage that is resized is not a tensor that dies). ``on_stream(id)`` hears of each
    change of the current stream (FSDP2's all-gather and reduce-scatter streams; 0 the
    default)."""
    try:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.fsdp._fully_shard import (
            _fsdp_collectives,
            _fsdp_param,
            _fsdp_param_group,
            _fsdp_state,
            _fully_shard,
        )
    except ImportError as e:
        raise ReferenceError_(
            f"tracing FSDP2 needs torch 2.6 or newer, where fully_shard is public (this is {torch.__version__})"
        ) from e
    # PyTorch's own handle, not an earlier job's stand-in (one process traces many jobs).
    real = getattr(_fsdp_param_group, "_gpumem_handle", _fsdp_param_group._get_device_handle)
    _fsdp_param_group._gpumem_handle = real
    device = _MetaDevice(on_stream)
    handle = lambda kind: device if kind == "meta" else real(kind)
    for m in (_fsdp_collectives, _fsdp_param_group, _fsdp_state):
        m._get_device_handle = handle
    _fully_shard._get_device_from_mesh = lambda mesh: torch.device("meta")
    _fsdp_param_group.FSDPParamGroup._validate_no_meta_params = lambda self: None
    group = _fsdp_param_group.FSDPParamGroup
    if not hasattr(group, "_gpumem_finalize"):
        # A stray prefetch's event (a pipeline stage's backward prefetches a layer it never
        # runs) is waited on through torch.accelerator, which would start CUDA: the meta
        # device's stream instead, for that call.
        group._gpumem_finalize = group.finalize_backward

        def finalize_backward(self):
            current = torch.accelerator.current_stream
            torch.accelerator.current_stream = lambda *a, **k: _MetaDevice.DEFAULT
            try:
                group._gpumem_finalize(self)
            finally:
                torch.accelerator.current_stream = current

        group.finalize_backward = finalize_backward
    alloc_storage, free_storage = getattr(
        _fsdp_param, "_gpumem_storage", (_fsdp_param.alloc_storage, _fsdp_param.free_storage)
    )
    _fsdp_param._gpumem_storage = (alloc_storage, free_storage)

    def alloc(tensor):
        alloc_storage(tensor)
        on_alloc(tensor)

    def free(tensor):
        on_free(tensor)
        free_storage(tensor)

    _fsdp_param.alloc_storage, _fsdp_param.free_storage = alloc, free
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    policy = dict(
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype is not None else None
        ),
        offload_policy=CPUOffloadPolicy(pin_memory=False) if cpu_offload else OffloadPolicy(),
    )
    if cpu_offload:
        _offload_on_meta(_fsdp_param, _fsdp_param_group)
    if experts:
        from torch.distributed.tensor import Shard

        edp = (
            experts_mesh["replicate", "efsdp"]
            if experts_mesh["replicate"].size() > 1
            else experts_mesh["efsdp"]
        )
        wide = experts_mesh["efsdp"].size() * experts_mesh["ep"].size() > experts[0].num_experts
    for b in blocks:
        for e in experts:
            if any(e is m for m in b.modules()):
                fully_shard(
                    e,
                    **{**policy, "mesh": edp},
                    shard_placement_fn=(lambda p: Shard(1)) if wide else None,
                )
        fully_shard(b, **policy)
    fully_shard(model, **policy)
    return model


@contextlib.contextmanager
def _meshes_on_the_trace_device(model):
    """A real run's meshes are on the GPU's device type, where torch.distributed.checkpoint's
    gathers and copies need no move first; here they are on ``cpu``, so for the call they say
    the trace's device (``_device_type`` behind a read-only property from torch 2.10)."""
    from torch.distributed.tensor import DTensor

    meshes = {
        id(p.device_mesh): p.device_mesh for p in model.parameters() if isinstance(p, DTensor)
    }

    def attr(m):
        read_only = isinstance(getattr(type(m), "device_type", None), property)
        return "_device_type" if read_only else "device_type"

    saved = {k: getattr(m, attr(m)) for k, m in meshes.items()}
    try:
        for m in meshes.values():
            setattr(m, attr(m), "meta")
        yield
    finally:
        for k, m in meshes.items():
            setattr(m, attr(m), saved[k])


def unreduced_gradients(module):
    """An FSDP module's gradients still unsharded, accumulated over micro-batches (a pipeline
    chunk's, or a model's under ``no_sync``): FSDP's fp32 accumulators, or its gathered
    parameters' own."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not isinstance(module, FSDPModule):
        return []
    out = []
    for state in fully_shard.state(module)._state_ctx.all_states:
        group = state._fsdp_param_group
        for param in group.fsdp_params if group is not None else ():
            grad = getattr(param, "unsharded_accumulated_grad", None)
            if grad is None:
                unsharded = getattr(param, "_unsharded_param", None)
                grad = getattr(unsharded, "grad", None)
            if grad is not None:
                out.append(grad)
    return out


def fsdp_state_dicts(model, optimizer, how):
    """A checkpoint of an FSDP2 job, as torch.distributed.checkpoint's state-dict functions make
    it (run here): ``get_model_state_dict`` and ``get_optimizer_state_dict`` with
    ``full_state_dict`` for ``full`` and ``full-offload`` — each DTensor redistributed to
    Replicate, an all-gather into a whole tensor on the GPU, kept there (``full``) or copied to
    the host at once (``full-offload``: ``cpu_offload=True``, rank 0's) — and for ``sharded``
    the rank's own shards, nothing gathered. Both dicts are held until they are written, then
    dropped."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=how != "sharded", cpu_offload=how == "full-offload")
    with _meshes_on_the_trace_device(model):
        model_state = get_model_state_dict(model, options=options)
        optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    del model_state, optimizer_state


def fsdp_resume(model, optimizer):
    """An FSDP2 job resumed from its sharded checkpoint, as torch.distributed.checkpoint does it
    (torchtitan's and accelerate's way; run here): ``get_optimizer_state_dict`` makes the
    state the checkpoint is read into — on a fresh optimizer, PyTorch's ``_init_optim_state``:
    a zero gradient for every parameter and one step at learning rate 0, then the gradients
    freed — ``dcp.load`` fills it in place, and ``set_optimizer_state_dict`` hands it to the
    optimizer. The model's shards are read into the parameters in place: nothing more."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    with _meshes_on_the_trace_device(model):
        state = get_optimizer_state_dict(model, optimizer)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state)
    del state
