"""The training loop the tracer runs, mirroring a standard PyTorch loop on a CUDA device:

    for inputs, labels in loader:            # rebinding drops last iteration's GPU batch
        inputs, labels = inputs.cuda(), labels.cuda()
        optimizer.zero_grad()                 # set_to_none: frees the gradients
        with autocast(): outputs = model(inputs); loss = loss_fn(outputs, labels)
        scaler.scale(loss).backward()         # or loss.backward()
        scaler.step(optimizer); scaler.update()   # or optimizer.step()

Hugging Face models train as their Trainer runs them, ``loss = model(**batch).loss``: the output
(the logits) is not held through backward (``--outputs kept`` for a loop that holds it).
"""

import contextlib
import copy
import time
from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint

from . import (
    ac,
    amp,
    compiled,
    cuda,
    distributed,
    float8,
    hf_trainer,
    liger,
    lora,
    losses,
    offload,
    optimizers,
    pipeline,
    routing,
    sdpa,
    standin,
    zero,
)
from .device import DEVICE, to_device_keeping_ties
from .generation import generate
from .models import ReferenceError_, outputs_in_fp32, resolve
from .parallel import DataParallel
from .sdpa import Stack
from .tracer import ModulePaths, Recorder, TraceMode, storage_key


@dataclass
class TraceOptions:
    model: str
    batch: int = 32
    optimizer: str = "adam"
    precision: str = "fp32"
    iterations: int = 3
    input_shape: tuple = None
    seq_len: int = None
    # One sequence length per iteration (batches padded to a length that varies by step): the
    # loop runs them in this order, every one (none copied), and `iterations` is their count.
    seq_lens: tuple = None
    gpu_capability: str = "8.0"  # compute capability of the GPU the job will run on
    sdpa: str = (
        None  # a forced attention kernel (flash, efficient, cudnn, math), else PyTorch's choice
    )
    checkpointing: str = "off"  # a mode of ac.MODES: whose meaning of checkpointing

    channels_last: bool = False
    grad_accum: int = 1
    data_parallel: int = 1  # GPUs of a torch.nn.DataParallel job (traced as GPU 0)
    validate: str = "none"  # after training: two eval-mode batches, "no-grad" or "grad"
    outputs: str = None  # "kept" or "dropped" through backward; None: the model source's usual loop
    attention_mask: str = (
        "none"  # "padded": Hugging Face models get the attention mask of a padded batch
    )
    attention: str = None  # "sdpa", "eager" or "flash": a Hugging Face model's implementation
    lora: object = None  # a lora.Lora: PEFT-style LoRA fine-tuning
    optimizer_in_backward: bool = (
        False  # each parameter stepped in backward (optimizers.InBackward)
    )
    keep_grads: bool = False  # zero_grad(set_to_none=False): gradients zeroed, not freed
    chunked_ce: int = None  # torchtune's chunked cross-entropy over this many slices (losses.py)
    compile: bool = False  # the loss compiled as the trainer compiles it (compiled.py)
    liger: dict = None  # Liger's kernels, {name: on} over Liger's defaults (liger.py), or None
    float8: dict = None  # torchao's float8 training of the linear layers (float8.py), or None
    # torchtune's OffloadActivations around the forward (offload.py).
    activation_offloading: bool = False
    reference_model: bool = False  # TRL's frozen KL reference beside the model (losses.py)
    # The whole run (docs/run.md) as the job document states it — {"evaluation": {...}} — or
    # None: the training steps alone.
    whole_run: dict = None
    strategy: str = None  # "ddp", "fsdp", "zero1", "zero2" or "zero3": one rank of a multi-GPU job (the batch is the rank's)
    world_size: int = 1
    bucket_cap_mb: float = 25.0
    bucket_view: bool = False  # DDP's gradient_as_bucket_view
    reshard_after_forward: bool = True  # FSDP2's
    fsdp_param_dtype: str = None  # FSDP2's MixedPrecisionPolicy param_dtype: "bf16" or "fp16"
    replicas: int = 1  # FSDP2 over a 2-D mesh (HSDP): replicated this many times
    tensor: int = 1  # tensor-parallel ranks (distributed.tensor_parallel), within world_size
    sequence_parallel: bool = True  # with tensor: the stream between layers split over the sequence
    # Expert-parallel ranks (distributed.expert_parallel), borrowed from FSDP's and tensor
    # parallelism's, and the router's stand-in imbalance (routing.py).
    expert: int = 1
    routing_imbalance: float = 1.0
    context: int = 1  # context-parallel ranks (distributed.context_parallel), within world_size
    pipeline: int = 1  # pipeline stages (pipeline.py), within world_size
    pipeline_rank: int = 0  # which stage's rank the trace is
    schedule: str = None  # pipeline.SCHEDULES
    microbatches: int = 1  # the rank's batch split into this many for the schedule
    virtual_stages: int = 1  # chunks per pipeline rank (interleaved schedules)
    cpu_offload: bool = (
        False  # FSDP2's CPUOffloadPolicy: shards, gradients and the optimizer step on the host
    )
    # FSDP under accumulation: each micro-batch's gradients reduce-scattered as made (else
    # they accumulate unsharded until the last, FSDP's no_sync: accelerate's, Fabric's way).
    sync_each_batch: bool = False
    zero: object = None  # a zero.ZeroConfig for the zero strategies
    depth: int = None  # trace the model cut to this many of its repeated blocks (see cut_blocks)
    # With depth: cut even a job whose buffers span blocks (SPANS_BLOCKS), whose cut traces
    # cannot rebuild its whole depth but do show what the batch does to each block's events.
    cut_spanning: bool = False
    every_iteration: bool = False  # run every iteration, even those the steady state repeats
    document: dict = None  # the options as the request stated them, written into the header
    lr: float = 1e-3
    extra: dict = field(default_factory=dict)


# --precision: (autocast dtype, dtype of the weights and optimizer state when not fp32).
PRECISIONS = {
    "fp32": (None, None),
    "amp-fp16": (torch.float16, None),
    "amp-bf16": (torch.bfloat16, None),
    "fp16": (None, torch.float16),
    "bf16": (None, torch.bfloat16),
}


def make_optimizer(name, params, lr):
    """The optimizer gpumem calls ``name`` (see optimizers.py)."""
    return optimizers.make(name, params, lr)


class GradScaler:
    """torch.amp.GradScaler's tensor work without its host synchronisation (no values on meta)."""

    def __init__(self):
        self.scale_t = None

    def scale(self, loss):
        if self.scale_t is None:
            self.scale_t = torch.full((), 65536.0, device=DEVICE)
            self.growth = torch.full((), 0, dtype=torch.int32, device=DEVICE)
        return loss * self.scale_t

    def step(self, optimizer):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        inv = self.scale_t.double().reciprocal().float()
        found = torch.full((), 0.0, device=DEVICE)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        del inv
        optimizer.step()
        torch._amp_update_scale_(self.scale_t, self.growth, found, 2.0, 0.5, 2000)


def _has_moe(model):
    """Whether ``model`` has mixture-of-experts layers (torchtitan's ``moe_enabled`` blocks)."""
    layers = getattr(model, "layers", None)
    return layers is not None and any(
        getattr(b, "moe_enabled", False) for b in getattr(layers, "values", lambda: layers)()
    )


def repeated_blocks(model, name, purpose):
    """The instances of the model's most repeated composite block (ties: the outermost) with
    trainable parameters — what one checkpoints or shards by hand (FSDP's
    ``apply_activation_checkpointing`` with a block-type check, ``fully_shard`` per layer).
    Containers (Sequential, ModuleList, ModuleDict) are not blocks."""
    containers = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
    count, depth = {}, {}

    def visit(m, d):
        for c in m.children():
            # A LoRA layer wraps one layer: the block is what holds the layers.
            if lora.is_adapter(c):
                continue
            if (
                not isinstance(c, containers)
                and next(c.children(), None) is not None
                and any(p.requires_grad for p in c.parameters())
            ):
                count[type(c)] = count.get(type(c), 0) + 1
                depth[type(c)] = min(depth.get(type(c), d), d)
            visit(c, d + 1)

    visit(model, 0)
    if not count or max(count.values()) < 2:
        raise ReferenceError_(f"{name}: {purpose} needs repeated blocks, and this model has none")
    block = max(count, key=lambda t: (count[t], -depth[t]))
    return [m for m in model.modules() if type(m) is block]


# DDP's buckets, ZeRO's flat partitions and gathers span blocks: they change with the depth,
# which gpumem's rebuild refuses (a buffer over blocks may reach a bucket cap beyond the traced
# depths), so such a job's whole depth is traced, and cut only for the batch's effect.
SPANS_BLOCKS = ("ddp", "zero1", "zero2", "zero3")

# Below this many blocks, cut traces cost about what they save: each of the three runs the
# embedding, the head and the loop again (GPT-2's 12 layers: 14.8 s cut against 12.3 s whole).
MIN_CUT_BLOCKS = 16


def cut_blocks(model, name, depth):
    """Cuts the model's stack of repeated blocks (a transformer's layers) to its first ``depth``
    and returns how many it had — where the blocks are one ModuleList or Sequential of at least
    ``MIN_CUT_BLOCKS`` (and more than ``depth``) blocks of identical parameter shapes, the only
    case where the events one block adds repeat; else None, and the model is left whole.
    gpumem traces a few depths and rebuilds the whole depth from them (gpumem_core::depth)."""
    try:
        blocks = repeated_blocks(model, name, "depth")
    except ReferenceError_:
        return None
    stacks = [
        m
        for m in model.modules()
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))
        and len(m) == len(blocks)
        and all(a is b for a, b in zip(m, blocks))
    ]
    shapes = {
        tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in b.named_parameters())
        for b in blocks
    }
    if len(stacks) != 1 or len(shapes) != 1 or len(blocks) < max(MIN_CUT_BLOCKS, depth + 1):
        return None
    del stacks[0][depth:]
    return len(blocks)


def enable_checkpointing(model, name, mode="full", autocast=None):
    """Activation checkpointing ``mode`` (ac.MODES) as the model's users switch it on: the
    model's own switch where it has one (timm's ``set_grad_checkpointing``, Hugging Face's
    ``gradient_checkpointing_enable``, which also turns its KV cache off, as checkpointing
    must), else every repeated block by hand; torchtitan's modes by torchtitan's own code where
    it is installed (see ac.py). ``autocast``: the emulated one the trace runs under, which the
    recomputation must join. Returns ``(wrappers, how)`` as ``ac.apply``."""
    return ac.apply(
        model,
        lambda: repeated_blocks(model, name, "activation checkpointing"),
        mode,
        autocast,
    )


def _count_activations(model):
    """Per-sample sum of leaf-module output sizes (the Horus formula's input)."""
    total = [0]
    handles = []

    def hook(_m, _i, out):
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                total[0] += t.numel() // max(t.shape[0], 1)

    for m in model.modules():
        if not list(m.children()):
            handles.append(m.register_forward_hook(hook))
    return total, handles


def attention_stack(opts: TraceOptions):
    """How attention calls choose their kernel: FlashAttention-2 (``--attention flash``) runs
    as SDPA's flash kernel, which keeps what it keeps, and nothing else will do."""
    if opts.attention == "flash":
        return Stack.here(opts.gpu_capability, sdpa.FLASH, required=True)
    return Stack.here(opts.gpu_capability, opts.sdpa)


def evaluate(evaluation, next_batch, batch, forward_and_loss, end_autocast, model, rec, world):
    """Hugging Face Trainer's evaluation loop (``Trainer.evaluate`` → ``evaluation_loop``), one
    batch at a time under ``torch.no_grad()`` in eval mode: ``prediction_step`` runs the model
    with its labels and keeps the loss, repeated once per sample; with metrics (``logits``) also
    the logits and the labels. Each is gathered across ranks (``gather_for_metrics``: an
    all-gather into a tensor ``world`` times as large where there are several) and concatenated
    to what the loop holds (``EvalLoopContainer.add`` → transformers' ``nested_concat``, run
    here where transformers is installed); every ``accumulation_steps`` batches what it holds
    moves to the host (``to_cpu_and_numpy``) and leaves the GPU, and the loop calls
    ``torch.cuda.empty_cache()``. With ``inputs`` the batch's inputs are kept too; with
    ``as_list`` (``eval_do_concat_batches=False``) what is kept is a list of batches, never
    concatenated. Returns the last batch."""
    concat = _nested_concat()
    kept = {}  # name -> the tensor the loop holds on the GPU

    def add(name, tensor):
        if world > 1:
            tensor = torch.empty(
                (tensor.shape[0] * world, *tensor.shape[1:]), dtype=tensor.dtype, device=DEVICE
            )
        if evaluation.get("as_list"):  # eval_do_concat_batches=False: a list of batches
            kept.setdefault(name, []).append(tensor)
        else:
            kept[name] = tensor if name not in kept else concat(kept[name], tensor)

    model.eval()
    rec.kernels = False
    steps = evaluation.get("accumulation_steps")
    with torch.no_grad():
        for step in range(evaluation["batches"]):
            batch = next_batch(batch)
            rec.phase = "forward"
            outputs, loss = forward_and_loss(batch)
            end_autocast()
            # prediction_step returns (loss, logits, labels): the rest of the output (an
            # evaluating language model's key/value cache) dies before the loop keeps them.
            logits = outputs.logits if hasattr(outputs, "logits") else outputs
            outputs = None
            size = batch[0].shape[0]
            add("losses", loss.detach().mean().repeat(size))
            if evaluation.get("logits"):
                add("preds", logits.detach())
                if len(batch) > 1:
                    add("labels", batch[1])
                if evaluation.get("inputs"):  # include_for_metrics=["inputs"]
                    add("inputs", batch[0])
            loss = logits = None
            if steps and (step + 1) % steps == 0:
                kept.clear()  # moved to the host: the GPU's copies die
                batch[:] = [None] * len(batch)  # `del losses, logits, labels, inputs`
                rec.empty_cache()  # and the Trainer empties the allocator's cache
    kept.clear()
    rec.kernels = True
    model.train()
    return batch


def _nested_concat():
    """transformers' ``nested_concat`` (what the Trainer's ``EvalLoopContainer`` calls), or,
    without transformers, the ``torch.cat`` along the batch it runs for same-shaped tensors."""
    try:
        from transformers.trainer_pt_utils import nested_concat
    except ImportError:
        return lambda a, b: torch.cat((a, b), dim=0)
    return lambda a, b: nested_concat(a, b, padding_index=-100)


def trace_training(opts: TraceOptions, out_path: str):
    """Runs the loop and writes the trace to ``out_path``; returns the header."""
    t0 = time.time()
    job = resolve(
        opts.model,
        input_shape=opts.input_shape,
        seq_len=opts.seq_len,
        batch_hint=opts.batch,
        attention_mask=opts.attention_mask,
        attention=opts.attention,
        gpu_capability=opts.gpu_capability,
    )
    model = job.model
    model.train()
    # TRL's create_reference_model: a copy of the model as loaded, frozen, in eval mode.
    reference = copy.deepcopy(model).eval().requires_grad_(False) if opts.reference_model else None
    if opts.lora and job.own_lora is not None:
        # The trainer's own LoRA model (litgpt's), quantized as its loader quantizes.
        model = job.own_lora(opts.lora, lambda m: lora.quantize(m, opts.lora, fabric=True))
    elif opts.lora:
        # As one fine-tunes with PEFT: get_peft_model on the loaded model, then the loop.
        lora.apply(model, opts.lora, opts.model)
    if opts.chunked_ce:
        job = losses.chunked_output(job, model, opts.chunked_ce, opts.model)
    compiled_loss = compiled.compile_loss(job, model, opts.model) if opts.compile else None
    if opts.liger is not None:
        # As Hugging Face's Trainer does, on the model it is given (after PEFT's wrapping).
        liger.apply(model, opts.liger, opts.model)
    if opts.float8:
        # torchtitan's order: the model's converters before any parallelism.
        float8.convert(model, opts.float8)
    ranks = None  # the job's DeviceMesh, where it is a multi-GPU job that needs one
    if opts.strategy == "fsdp":
        ranks = distributed.device_mesh(
            opts.world_size, opts.replicas, opts.tensor, opts.pipeline, opts.context
        )
    sharded_loss = contextlib.nullcontext()
    if opts.tensor > 1:
        # As torchtitan orders it: tensor parallelism first, then checkpointing, then FSDP.
        distributed.tensor_parallel(
            model, ranks["tensor"], opts.model, opts.context > 1, opts.sequence_parallel
        )
        sharded_loss = distributed.loss_parallel(model)
    cut_batch = None
    if opts.context > 1:
        # torchtitan's order: context parallelism after tensor parallelism. Each step's batch
        # is cut to the rank's chunks of the sequence before the model sees it (before a
        # pipeline's schedule splits it into micro-batches, as torchtitan's train step does).
        cut_batch = distributed.context_parallel(model, ranks["context"], opts.model)

        def forward_on_chunks(m, b):
            b[0], b[1], kwargs = cut_batch(b[0], b[1])
            return m(b[0], **kwargs)

        job.forward = forward_on_chunks
    experts, experts_mesh = [], None
    if opts.expert > 1 or (opts.tensor > 1 and _has_moe(model)):
        # torchtitan's order: the MoE layers' expert and tensor parallelism after the rest's.
        if opts.expert > 1:
            experts_mesh = distributed.expert_mesh(
                opts.world_size, opts.replicas, opts.pipeline, opts.expert
            )
        experts = distributed.expert_parallel(
            model, ranks["tensor"] if opts.tensor > 1 else None, experts_mesh, opts.model
        )
    # FSDP applies where its dimensions have ranks to shard over (torchtitan: dp_shard > 1).
    sharded = opts.strategy == "fsdp" and opts.world_size > opts.tensor * opts.pipeline
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)  # the whole model's
    # DataParallel's coalesced broadcasts span blocks too, and its replicas split the batch.
    cut = (
        opts.depth
        and opts.data_parallel == 1
        and (opts.cut_spanning or opts.strategy not in SPANS_BLOCKS)
        # Layer-wise checkpointing treats every Nth block apart: no one block repeats.
        and not ac.changes_by_block(opts.checkpointing)
        # A pipeline rank holds its share of the blocks, and with several micro-batches in
        # flight a backward frees one of theirs that no pick by recency names at every depth.
        and opts.pipeline == 1
    )
    blocks = cut_blocks(model, opts.model, opts.depth) if cut else None
    if opts.precision not in PRECISIONS:
        raise ReferenceError_(
            f"unknown precision `{opts.precision}` (expected {', '.join(PRECISIONS)})"
        )
    autocast_dtype, weights_dtype = PRECISIONS[opts.precision]
    autocast = amp.Autocast(autocast_dtype) if autocast_dtype else None
    # FSDP2's units are the blocks as checkpointing leaves them: a block a wrapper module
    # replaced (torchtitan's checkpoint_wrapper) is sharded as that wrapper, as torchtitan does.
    units = repeated_blocks(model, opts.model, "FSDP") if sharded else None
    wrappers, _ = enable_checkpointing(model, opts.model, opts.checkpointing, autocast)
    rec = Recorder()
    schedule = None
    if opts.pipeline > 1:
        # The rank's chunks after checkpointing (a wrapped block is held as its wrapper) and
        # before FSDP, which shards each chunk as torchtitan shards each model part.
        config = getattr(model, "config", None)
        hidden = config.hidden_size if config is not None else model.model_args.dim
        model = pipeline.split(
            model,
            opts.model,
            opts.pipeline,
            opts.virtual_stages,
            opts.pipeline_rank,
            ranks["tensor"] if opts.tensor > 1 else None,
            loss=lambda out, labels: job.loss(out, [None, labels]),
        )
        if sharded and isinstance(model.chunks[0], pipeline.TitanChunk):
            # Each torchtitan part is a copy of the model: its own blocks (as checkpointing
            # left them) are FSDP's units.
            units = [b for c in model.chunks for b in c.part.layers.values()]
        schedule = pipeline.Schedule(
            model,
            opts.schedule,
            opts.pipeline_rank,
            opts.pipeline,
            opts.microbatches,
            rec,
            weights_dtype or torch.float32,
        )
    paths = ModulePaths(model)
    mode = TraceMode(
        rec,
        paths,
        DEVICE,
        dtensor_dispatch=opts.tensor > 1 or opts.context > 1,
        routing=routing.Routing(opts.expert, opts.routing_imbalance),
        unwrapped=float8.subclasses() if opts.float8 else (),
    )
    specs = job.batch_specs(opts.batch)
    if opts.seq_lens:
        if job.specs_at is None:
            raise ReferenceError_(
                f"{opts.model}: a sequence length that varies by step (--seq-len MIN..MAX) applies to models that read token ids"
            )
        step_specs = [job.specs_at(opts.batch, n) for n in opts.seq_lens]
    else:
        step_specs = [specs] * opts.iterations
    acts, hooks = _count_activations(model)
    parallel = DataParallel(model, opts.data_parallel) if opts.data_parallel > 1 else None
    if opts.strategy not in (None, "ddp", "fsdp", "zero1", "zero2", "zero3"):
        raise ReferenceError_(
            f"unknown strategy `{opts.strategy}` (expected ddp, fsdp, zero1, zero2 or zero3)"
        )
    engine = None  # DeepSpeed ZeRO's, which stands in for the optimizer
    if opts.zero is not None and opts.zero.stage == 3:
        # zero.Init: the model is built partitioned; only each rank's partitions reach the GPU.
        to_device_keeping_ties(model, weights_dtype)
    if sharded:
        # FSDP2 as one applies it: fully_shard on each layer, then on the model, before anything
        # reaches the GPU (the model is built on meta or the host; only shards move).
        units = [wrappers.get(u, u) for u in units]
        # FSDP's roots: the model, or each pipeline chunk the rank holds (with its own blocks).
        roots = [
            (root, [u for u in units if any(u is m for m in root.modules())])
            for root in (model.chunks if schedule else [model])
        ]
        if weights_dtype is not None:
            model.to(weights_dtype)
    if opts.strategy and parallel:
        raise ReferenceError_("a job is DataParallel or DistributedDataParallel, not both")
    runner = model  # what the loop calls: the model, or its DDP wrapper once built
    # `loss = model(**batch).loss` (Hugging Face's Trainer) drops the model's output before
    # backward; `outputs = model(x); loss = criterion(outputs, y)` keeps it alive through it.
    keep_outputs = job.keeps_outputs if opts.outputs is None else opts.outputs == "kept"
    outputs_fp32 = job.returns_fp32_outputs(keep_outputs, opts.precision)

    def next_batch(old, specs):
        """The loop head rebinds `inputs, labels = ...`: the old batch dies, in that order,
        before the new one is moved to the GPU."""
        for i in range(len(old or [])):
            old[i] = None
        rec.phase, rec.category = "forward", "input_batch"
        # Pure low-precision training feeds its inputs in the weights' dtype.
        new = [
            torch.empty(
                shape,
                dtype=weights_dtype if weights_dtype and dtype.is_floating_point else dtype,
                device=DEVICE,
            )
            for shape, dtype in specs
        ]
        if opts.channels_last and new[0].dim() == 4:
            new[0] = new[0].to(memory_format=torch.channels_last)
        rec.category = None
        return new

    def forward_and_loss(batch):
        """model(inputs) and the loss, under autocast and through DataParallel's
        scatter/replicate/gather where asked. The caller rebinds `outputs, loss` and then
        calls `end_autocast()`: leaving `with autocast():` clears the cast cache only after the
        assignments inside it have dropped the previous outputs."""
        with autocast if autocast is not None else contextlib.nullcontext():
            # torchtune offloads what the model's forward saves, not the loss's.
            with offloading:
                outputs = parallel(job.forward, batch) if parallel else job.forward(runner, batch)
            if outputs_fp32:
                outputs = outputs_in_fp32(outputs)
            loss = job.loss(outputs, batch)
            if loss.dim() > 0:  # DataParallel gathers one loss per replica: `loss.mean()`
                loss = loss.mean()
        return outputs, loss

    def end_autocast():
        if autocast is not None:
            autocast.clear()

    with (
        cuda.patches(attention_stack(opts)),
        amp.model_autocast_calls(),
        paths,
        mode,
        autocast.under_checkpoint() if autocast else contextlib.nullcontext(),
        sharded_loss,
        liger.on_the_gpu(standin.StandinGpu.with_capability(opts.gpu_capability), rec)
        if opts.liger is not None
        else contextlib.nullcontext(),
        offload.on_meta(model, opts.model, rec)
        if opts.activation_offloading
        else contextlib.nullcontext(contextlib.nullcontext()) as offloading,
    ):
        whole_run = opts.whole_run is not None
        if whole_run:
            rec.run_phase("load")
        rec.phase = "setup"
        if sharded:
            # Offloaded, the model is sharded where it was loaded: on the host.
            with rec.on_host() if opts.cpu_offload else contextlib.nullcontext():
                for root, units_of_root in roots:
                    distributed.fsdp(
                        root,
                        units_of_root,
                        distributed.data_parallel_mesh(ranks),
                        opts.reshard_after_forward,
                        on_alloc=lambda t: mode.track(t, "fsdp_all_gather"),
                        on_free=lambda t: rec.free(storage_key(t)),
                        on_stream=lambda stream_id: setattr(rec, "stream", stream_id),
                        param_dtype={None: None, "bf16": torch.bfloat16, "fp16": torch.float16}[
                            opts.fsdp_param_dtype
                        ],
                        cpu_offload=opts.cpu_offload,
                        experts=experts,
                        experts_mesh=experts_mesh,
                    )
            if (opts.whole_run or {}).get("broadcast_load"):
                with rec.labelled("temporary"):
                    distributed.broadcast_load(model, DEVICE)
        elif opts.zero is not None:
            engine = zero.Engine(
                model, opts.zero, opts.optimizer, weights_dtype or torch.float32, rec
            )
        else:
            # A whole run loads a 4-bit model as transformers does: each weight reaches the GPU
            # in the dtype it is loaded in (the training's 16 bits) and is quantized there.
            loaded = weights_dtype or autocast_dtype or torch.float32

            def stage(shape, dtype):
                with rec.labelled("temporary"):
                    return torch.empty(shape, dtype=dtype or loaded, device=DEVICE)

            if whole_run and autocast_dtype is not None and opts.lora and opts.lora.quant:
                # QLoRA under autocast, as its recipe runs: from_pretrained(dtype=16 bits)
                # loads every weight in 16 bits, PEFT's prepare_model_for_kbit_training casts
                # those not 4-bit to fp32, and only then does get_peft_model add the factors.
                later = {id(p) for p in lora.factors(model)}
                with lora.loading_in_4bit(stage):
                    to_device_keeping_ties(model, loaded, only=lambda t: id(t) not in later)
                lora.cast_as_prepare_model_for_kbit_training(model, rec.empty_cache)
                to_device_keeping_ties(model, only=lambda t: id(t) in later)
            else:
                with lora.loading_in_4bit(stage if whole_run else None):
                    to_device_keeping_ties(model, weights_dtype)
        if reference is not None:
            to_device_keeping_ties(reference, weights_dtype)
        if opts.channels_last:
            model.to(memory_format=torch.channels_last)
        if opts.strategy == "ddp":
            runner = distributed.ddp(
                model,
                opts.world_size,
                opts.bucket_cap_mb,
                opts.bucket_view,
                on_bucket=lambda t: rec.relabel(t, "gradient"),
                rebuilding=lambda: rec.parameter_sized("ddp_rebuild_buckets"),
            )
        trainable = [
            p for n, p in model.named_parameters() if p.requires_grad and n not in job.unoptimized
        ]
        if opts.optimizer_in_backward:
            optimizer = optimizers.InBackward(
                trainable,
                lambda ps: make_optimizer(opts.optimizer, ps, opts.lr),
                on_grad=lambda g: rec.relabel(g, "gradient"),
            )
        else:
            optimizer = engine or make_optimizer(opts.optimizer, trainable, opts.lr)
        if (opts.whole_run or {}).get("resume"):
            # The checkpoint's optimizer state read in beside the live model, before any step
            # (its weights are read into the parameters in place).
            with rec.labelled("temporary"):
                if opts.strategy == "fsdp":
                    distributed.fsdp_resume(model, optimizer)
                elif engine:
                    engine.load_checkpoint()
                else:
                    optimizers.resume_as_torch_load(optimizer, rec)
            for t, category in optimizers.state_tensors(optimizer, DEVICE):
                rec.relabel(t, category)
        scaler = GradScaler() if opts.precision == "amp-fp16" else None
        batch = outputs = loss = None
        scored = {}  # what TRL computes for a batch beside it (the reference's log-probabilities)
        if whole_run:
            rec.run_phase("train")
        # FSDP under accumulation without sync_each_batch: reduction deferred to the last
        # micro-batch (a pipeline's schedule runs its own).
        deferred = sharded and not schedule and opts.grad_accum > 1 and not opts.sync_each_batch
        for it in range(len(step_specs)):
            # From the third iteration on, a loop in its steady state repeats the last one:
            # copied, not run (about a quarter of the tracing time). A validation pass after
            # training would need the tensors each copy made, so with one every iteration runs.
            if (
                it >= 2
                and not opts.every_iteration
                and not opts.seq_lens
                and opts.validate == "none"
                and not whole_run
                and rec.repeat_last_iteration()
            ):
                while rec.iterations < opts.iterations and rec.repeat_last_iteration():
                    pass  # a copy of a copy is always steady: the loop ends
                rec.closed = True  # the copies' tensors exist only in the trace
                break
            for micro in range(opts.grad_accum):
                batch = next_batch(batch, step_specs[it])
                if micro == 0:
                    rec.phase = "zero_grad"
                    optimizer.zero_grad(set_to_none=not opts.keep_grads)
                if deferred:
                    # FSDP's no_sync: the gradients stay unsharded (and accumulate there)
                    # until the last micro-batch's backward reduce-scatters them.
                    for root, _ in roots:
                        root.set_requires_gradient_sync(micro == opts.grad_accum - 1)
                if schedule:
                    # The rank's micro-batches, forward and backward in its schedule's order.
                    kwargs = None
                    if cut_batch is not None:
                        batch[0], batch[1], kwargs = cut_batch(batch[0], batch[1])
                    with autocast if autocast is not None else contextlib.nullcontext():
                        schedule.step(batch[0], hidden, opts.tensor, kwargs)
                    end_autocast()
                    for h in hooks if it == 0 else ():
                        h.remove()
                    for p in model.parameters():
                        if p.grad is not None:
                            rec.relabel(p.grad, "gradient")
                    continue
                rec.phase = "forward"
                if reference is not None:
                    # TRL scores the batch with the reference first (under no_grad); its
                    # per-token log-probabilities stay with the step's inputs until the next.
                    scored["reference_logps"] = losses.reference_logps(
                        job,
                        reference,
                        batch,
                        autocast if autocast is not None else contextlib.nullcontext(),
                    )
                    end_autocast()
                outputs, loss = forward_and_loss(batch)
                if not keep_outputs:
                    outputs = None
                end_autocast()
                if it == 0 and micro == 0:
                    for h in hooks:
                        h.remove()
                if opts.grad_accum > 1:
                    loss = loss / opts.grad_accum
                rec.phase = "backward"
                if engine:
                    engine.backward_start()
                (scaler.scale(loss) if scaler else loss).backward()
                if engine:
                    engine.backward_end()
                if not keep_outputs:
                    # Hugging Face's training_step returns the loss detached: the step's
                    # autograd graph (and what its nodes hold beyond backward) dies here.
                    loss = loss.detach()
                for p in model.parameters():
                    if p.grad is not None:
                        rec.relabel(p.grad, "gradient")
                for root, _ in roots if deferred else ():
                    for grad in distributed.unreduced_gradients(root):
                        rec.relabel(grad, "gradient")
            rec.phase = "optimizer"
            # Offloaded, the optimizer steps the host's shards with the host's gradients.
            with rec.on_host() if opts.cpu_offload else contextlib.nullcontext():
                if scaler:
                    scaler.step(optimizer)
                else:
                    optimizer.step()
            if opts.float8 and sharded:
                float8.after_optimizer_step(model, opts.float8)
            for t, category in optimizers.state_tensors(optimizer, DEVICE):
                rec.relabel(t, category)
            rec.iteration_end()
        if opts.validate != "none":
            # The validation loop reuses the names: each batch, output and loss is rebound only
            # once the next exists. Under no_grad nothing more lives; without it (a common slip)
            # each output keeps its whole autograd graph until the next one is computed.
            model.eval()
            rec.kernels = False
            with torch.enable_grad() if opts.validate == "grad" else torch.no_grad():
                for _ in range(2):
                    batch = next_batch(batch, step_specs[-1])  # the last step's shape
                    outputs, loss = forward_and_loss(batch)
                    end_autocast()
            rec.kernels = True
        evaluation = (opts.whole_run or {}).get("evaluation")
        generation = (opts.whole_run or {}).get("generation")
        evaluated_by = None
        if evaluation or generation:
            # Hugging Face's Trainer zeroes the gradients after every step (to None, unless
            # they are kept).
            rec.phase = "zero_grad"
            optimizer.zero_grad(set_to_none=not opts.keep_grads)
        if evaluation:
            rec.run_phase("evaluate")
            outputs = loss = None
        if (
            evaluation
            and job.inputs
            and runner is model
            and not parallel
            and hf_trainer.available()
        ):
            # One GPU's Hugging Face job: the Trainer's own evaluation loop, on the stand-in
            # CUDA. The last step's batch dies first: the loop rebinds its names.
            batch = None
            rec.phase = "forward"
            rec.kernels = False
            evaluated_by = hf_trainer.evaluate(
                job,
                model,
                evaluation,
                opts.precision,
                evaluation.get("batch_size") or opts.batch,
                weights_dtype or torch.float32,
                standin.StandinGpu.with_capability(opts.gpu_capability),
                rec,
            )
            rec.kernels = True
            model.train()
        elif evaluation:
            batch = evaluate(
                evaluation,
                lambda old: next_batch(
                    old, job.batch_specs(evaluation.get("batch_size") or opts.batch)
                ),
                batch,
                forward_and_loss,
                end_autocast,
                model,
                rec,
                opts.world_size if opts.strategy else 1,
            )
        if generation:
            rec.run_phase("generate")
            batch = outputs = loss = None
            prompts = job.batch_specs(generation.get("batch_size") or opts.batch)[0][0]
            prompts = (prompts[0], generation.get("prompt_len") or prompts[-1])
            generate(
                model,
                prompts,
                generation["new_tokens"],
                autocast,
                rec,
                generation.get("filters"),
            )
        how = (opts.whole_run or {}).get("save")
        if how:
            rec.run_phase("save")
            rec.phase = "setup"
            del outputs, loss  # the last step's, or evaluation's, are gone by the save
            if opts.strategy == "fsdp":
                with rec.labelled("temporary"):
                    distributed.fsdp_state_dicts(model, optimizer, how)
            elif opts.zero is not None and how == "full":
                engine.consolidated_16bit_state_dict()
            # And torch.save of the state dicts (one GPU, DDP's rank 0, DeepSpeed's per-rank
            # files): serialization copies each storage to the host; nothing more on the GPU.
    if compiled_loss is not None and not compiled_loss.graphs:
        raise ReferenceError_(
            f"{opts.model}: --compile: the model's forward computes its loss without its "
            "loss_function (its own code, or an older transformers'), so gpumem cannot compile "
            "it; size it without --compile"
        )
    header = {
        "model": opts.model,
        "batch_size": opts.batch,
        # The job's options as gpumem's request stated them (the job vocabulary).
        "options": opts.document if opts.document is not None else {},
        "producer": "gpumem_trace/0.1.0",
        "framework": f"torch {torch.__version__}",
        "parameters": params,
        "activations_per_sample": int(acts[0]),
        "trace_seconds": round(time.time() - t0, 3),
    }
    if blocks:
        header["blocks"], header["depth"] = blocks, opts.depth
    if opts.zero is not None:
        header["largest_layer_parameters"] = zero.largest_layer_parameters(model)
    if rec.sized_by_parameters:
        header["sized_by_parameters"] = sorted(rec.sized_by_parameters)
    if opts.strategy in ("ddp", "zero1", "zero2", "zero3"):
        # DDP's all-reduce (a hook here) and DeepSpeed's collectives (modelled) run on the
        # default group: one communicator of every rank.
        c10d = torch.distributed.distributed_c10d
        # ZeRO's run joins no fake group: the default group's name as PyTorch gives it.
        default = c10d._get_default_group().group_name if c10d.is_initialized() else "0"
        rec.communicators.setdefault(default, opts.world_size)
    if rec.communicators:
        header["communicators"] = [
            {"name": name, "ranks": ranks} for name, ranks in sorted(rec.communicators.items())
        ]
    if evaluation:
        # Whose evaluation loop ran: the trainer's own code, or gpumem's restatement of it.
        header["evaluation_loop"] = evaluated_by or "gpumem (Hugging Face Trainer's, restated)"
    rec.write(out_path, header)
    return header
