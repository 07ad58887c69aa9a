"""Activation checkpointing as trainers mean it. "Selective" and "gradient checkpointing" mean
different things in different trainers, so each mode names whose meaning it is (the job
vocabulary's ``Checkpointing``, crates/gpumem-core/src/job/mod.rs; docs/intake.md):

- ``full``: every repeated block under non-reentrant ``torch.utils.checkpoint`` (the model's own
  switch where it has one — Hugging Face's ``gradient_checkpointing_enable``, timm's
  ``set_grad_checkpointing`` — asked for non-reentrant; torchtitan's ``mode = "full"``);
- ``full-reentrant``: the same under reentrant checkpoint (``use_reentrant=True``);
- ``selective``: gpumem's own op policy: every matmul and attention output saved;
- ``selective-op``: torchtitan's ``selective_ac_option = "op"``;
- ``selective-layer:N``: torchtitan's ``selective_ac_option = "N"``: every Nth block
  checkpointed whole, the others not at all.

torchtitan's two modes run torchtitan's own code (``_apply_op_sac``, ``_apply_layer_sac`` of
``torchtitan.distributed.activation_checkpoint``, with the save list of its Llama's
``parallelize``) wherever a torchtitan of that API (0.2.x) is importable; elsewhere they run
``titan_op_policy`` and ``titan_layer_wrapped``, gpumem's restatement of release
``TITAN_RELEASE``, which python/tests/test_titan.py holds to torchtitan's own decisions op by op.
"""

import contextlib
import functools
import importlib
import sys

# torch is imported by the functions that run checkpointing, not by this module: the request
# loader reads modes with it before anything imports torch.

# The torchtitan release whose policies the restatement below states.
TITAN_RELEASE = "0.2.2"

MODES = (
    "off",
    "full",
    "full-reentrant",
    "selective",
    "selective-op",
    "selective-attention",
    "selective-layer:N",
)


class ModeError(ValueError):
    """A checkpointing mode gpumem does not know."""


def parse(mode):
    """``(kind, every)`` of a mode as the job vocabulary spells it (``True``/``False``: full and
    off, as stored before the modes): kind one of MODES (selective-layer without its count);
    every the layer frequency (≥ 1) of selective-layer, else None."""
    if mode is True:
        return "full", None
    if mode in (False, None):
        return "off", None
    if mode in MODES[:-1]:  # every mode but selective-layer:N, which takes a count
        return mode, None
    if isinstance(mode, str) and mode.startswith("selective-layer:"):
        n = mode.split(":", 1)[1]
        if n.isdigit() and n.isascii() and int(n) >= 1:
            return "selective-layer", int(n)
    raise ModeError(f"unknown checkpointing `{mode}` (expected {', '.join(MODES)}, N ≥ 1)")


def mode_of(checkpointing, selective=False):
    """The canonical mode of flags: ``--checkpointing[=MODE]`` (``True``: full) and
    ``--selective`` (gpumem's selective policy, as before the modes)."""
    if selective:
        return "selective"
    kind, every = parse(checkpointing)
    return f"selective-layer:{every}" if every is not None else kind


def add_flags(parser):
    """``--checkpointing[ MODE]`` and ``--selective`` on an argparse parser."""
    parser.add_argument(
        "--checkpointing",
        nargs="?",
        const="full",
        default="off",
        metavar="MODE",
        help=f"activation checkpointing as a trainer means it: {', '.join(MODES)} (alone: full)",
    )
    parser.add_argument(
        "--selective",
        action="store_true",
        help="gpumem's selective policy (--checkpointing selective): matmul and attention outputs saved",
    )


def changes_by_block(mode):
    """Whether the mode treats blocks differently (layer-wise with N > 1): a model cut to a few
    blocks then does not repeat one block's events, so it is traced whole."""
    kind, every = parse(mode)
    return kind == "selective-layer" and every > 1


# gpumem's own selective policy (the `selective` mode): the outputs of matmuls and attention
# kernels are saved, everything else in a block is recomputed.
_SAVED_OPS = (
    "mm",
    "addmm",
    "bmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)


def gpumem_policy():
    """The `selective` mode's policy: one function for every context (it counts nothing)."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    saved = {getattr(torch.ops.aten, n).default for n in _SAVED_OPS if hasattr(torch.ops.aten, n)}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return lambda: policy


def _resolve(root, path):
    for part in path.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


# torchtitan 0.2.2's `_op_sac_save_list` (torchtitan/models/llama3/infra/parallelize.py), by
# name: ops the installed torch lacks (torch_attn's varlen kernel, the inductor HOP before 2.10)
# cannot occur in its trace, so leaving them out decides the same.
_TITAN_SAVE_LIST = (
    "ops.aten.mm.default",
    "ops.aten._scaled_dot_product_efficient_attention.default",
    "ops.aten._scaled_dot_product_flash_attention.default",
    "ops.aten._scaled_dot_product_cudnn_attention.default",
    "ops.aten._scaled_dot_product_attention_math.default",
    "ops.aten._scaled_dot_product_fused_attention_overrideable.default",
    "ops._c10d_functional.reduce_scatter_tensor.default",
    "ops.aten.max.default",
    "_higher_order_ops.flex_attention",
    "ops.torch_attn._varlen_attn.default",
    "_higher_order_ops.inductor_compiled_code",
)


def titan_save_ops():
    """The restated save list, as ops of the installed torch."""
    import torch

    return {op for op in (_resolve(torch, p) for p in _TITAN_SAVE_LIST) if op is not None}


def titan_op_policy(save_ops=None, mm_recompute_shapes=frozenset()):
    """Restatement of torchtitan 0.2.2's op policy (``_apply_op_sac``'s ``_custom_policy``):
    returns a maker of one policy per checkpointed call — torchtitan makes one per
    ``context_fn`` call, so its matmul count starts afresh in each block's forward, and counts
    the recomputation apart. A device-to-host copy is always saved; an ``mm`` whose right-hand
    shape is forced to recompute (torchtitan's ``per_op_sac_force_recompute_mm_shapes_by_fqns``,
    a MoE router's gate by default, which a dense model has not) is recomputed uncounted; of
    the rest, an op in the save list is saved, except every second ``mm``."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    save_ops = titan_save_ops() if save_ops is None else save_ops
    mm = torch.ops.aten.mm.default

    def make():
        count = {"forward": 0, "recompute": 0}

        def policy(ctx, func, *args, **kwargs):
            if (
                func == torch.ops.aten._to_copy.default
                and "cuda" in str(args[0].device)
                and "device" in kwargs
                and str(kwargs["device"]) == "cpu"
            ):
                return CheckpointPolicy.MUST_SAVE
            mode = "recompute" if ctx.is_recompute else "forward"
            if func == mm:
                if args[1].shape in mm_recompute_shapes:
                    return CheckpointPolicy.PREFER_RECOMPUTE
                count[mode] += 1
            if func in save_ops and not (func == mm and count[mode] % 2 == 0):
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return policy

    return make


def titan_layer_wrapped(index, every):
    """Restatement of torchtitan 0.2.2's ``_apply_layer_sac``: block ``index`` (0-based, in
    the order of the model's layers) is checkpointed when its 1-based count is a multiple of
    ``every`` (torchtitan counts in a global that starts at 0 in a fresh process)."""
    return (index + 1) % every == 0


def titan_module():
    """The installed torchtitan's activation checkpointing of the 0.2.x API (``_apply_op_sac``,
    ``_apply_layer_sac``, its ``ActivationCheckpoint`` config and its Llama's save list) as
    ``(module, config class, save list, version)``, or None where torchtitan is absent or of
    another API."""
    try:
        ac = importlib.import_module("torchtitan.distributed.activation_checkpoint")
        config = importlib.import_module("torchtitan.config.job_config").ActivationCheckpoint
        save = importlib.import_module(
            "torchtitan.models.llama3.infra.parallelize"
        )._op_sac_save_list
        version = importlib.import_module("torchtitan").__version__
    except (ImportError, AttributeError):
        return None
    if not all(hasattr(ac, f) for f in ("_apply_op_sac", "_apply_layer_sac")):
        return None
    return ac, config, save, version


def _with_recompute_context(context_fn, autocast):
    """``context_fn`` whose recompute context also enters the emulated autocast's (checkpoint's
    own autocast context cannot see an emulated autocast)."""
    if autocast is None:
        return context_fn

    def contexts():
        forward, recompute = context_fn()
        return forward, _together(recompute, autocast.recompute_context())

    return contexts


@contextlib.contextmanager
def _together(*contexts):
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


def contexts_of(make_policy, autocast):
    """A ``context_fn`` for checkpoint: selective contexts of a fresh policy per call."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    def context_fn():
        return create_selective_checkpoint_contexts(make_policy())

    return _with_recompute_context(context_fn, autocast)


def _parent_of(model, block):
    for m in model.modules():
        for name, c in m.named_children():
            if c is block:
                return m, name
    raise ValueError("block not found in its model")


def _checkpointed(forward, context_fn, reentrant, *args, **kwargs):
    import torch.utils.checkpoint

    # Lists are copied: the recomputation in backward must see them as they were (DenseNet
    # appends each layer's output to the list its layers receive).
    args = tuple(list(a) if isinstance(a, list) else a for a in args)
    if reentrant:
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=True, **kwargs)
    extra = {"context_fn": context_fn} if context_fn else {}
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)


def checkpoint_block(block, context_fn=None, reentrant=False):
    """``block`` run under ``torch.utils.checkpoint`` in place (its forward replaced)."""
    block.forward = functools.partial(_checkpointed, block.forward, context_fn, reentrant)


def apply(model, blocks, mode, autocast=None):
    """Applies checkpointing ``mode`` to ``model``, whose repeated blocks ``blocks()`` gives (in
    order; asked only where the blocks are wrapped by hand). Returns ``(wrappers, how)``: each block's replacement where a wrapper module took its
    place (what FSDP then shards, as torchtitan shards its wrapped blocks), and a line saying
    whose code decided (for the trace's header)."""
    kind, every = parse(mode)
    if kind == "off":
        return {}, None
    hf = hasattr(model, "gradient_checkpointing_enable")
    if kind in ("full", "full-reentrant"):
        reentrant = kind == "full-reentrant"
        own = f"the model's own switch, use_reentrant={reentrant}"
        if hasattr(model, "set_grad_checkpointing"):  # timm's: reentrant as timm.layers says
            timm_layers = importlib.import_module("timm.layers")
            if hasattr(timm_layers, "set_reentrant_ckpt"):
                timm_layers.set_reentrant_ckpt(reentrant)
                model.set_grad_checkpointing(True)
                return {}, own
            if not reentrant:  # a timm without the choice: non-reentrant
                model.set_grad_checkpointing(True)
                return {}, own
        elif hf:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": reentrant}
            )
            return {}, own
        for b in blocks():
            checkpoint_block(b, reentrant=reentrant)
        return {}, f"torch.utils.checkpoint per block, use_reentrant={reentrant}"
    if kind == "selective":
        contexts = contexts_of(gpumem_policy(), autocast)
        if hf:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": contexts}
            )
        else:
            for b in blocks():
                checkpoint_block(b, contexts)
        return {}, "gpumem's selective policy (every matmul and attention output saved)"
    if kind == "selective-attention":
        return {}, _recompute_core_attention(model)
    # torchtitan's modes wrap each block as torchtitan does; a Hugging Face model's blocks are
    # then called by its own forward, which must not keep a KV cache.
    if hf and getattr(model, "config", None) is not None:
        model.config.use_cache = False
    titan = titan_module()
    if titan is not None:
        return _apply_titan(model, blocks(), kind, every, autocast, titan)
    wrappers = {}
    for i, b in enumerate(blocks()):
        if kind == "selective-op":
            checkpoint_block(b, contexts_of(titan_op_policy(), autocast))
        elif titan_layer_wrapped(i, every):
            checkpoint_block(b)
    return wrappers, f"gpumem's restatement of torchtitan {TITAN_RELEASE}'s {kind} policy"


def _recompute_core_attention(model):
    """Megatron-LM's ``selective`` recomputation (``CheckpointWithoutOutput`` of its core
    attention) on a Hugging Face model: the attention function every attention layer calls with
    q, k and v — the model's own eager one, or the kernel its implementation names — registered
    with transformers' ``AttentionInterface`` under ``torch.utils.checkpoint`` (non-reentrant),
    so what it computes from q, k and v (QKᵀ, softmax, dropout, ·V) is recomputed in backward and
    q, k and v are what it keeps."""
    import torch.utils.checkpoint

    from .models import ReferenceError_

    config = getattr(model, "config", None)
    try:
        from transformers import AttentionInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        AttentionInterface = None
    if config is None or AttentionInterface is None:
        raise ReferenceError_(
            "selective-attention recomputes a Hugging Face model's attention function (transformers' AttentionInterface); this model has none"
        )
    impl = config._attn_implementation
    if impl == "eager":
        layers = [
            m
            for m in model.modules()
            if hasattr(sys.modules.get(type(m).__module__), "eager_attention_forward")
        ]
        if not layers:
            raise ReferenceError_(
                "selective-attention: this model's attention does not go through transformers' attention functions"
            )
        core = sys.modules[type(layers[0]).__module__].eager_attention_forward
    else:
        core = ALL_ATTENTION_FUNCTIONS[impl]

    def recomputed(module, query, key, value, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(
            core, module, query, key, value, *args, use_reentrant=False, **kwargs
        )

    name = f"gpumem-recomputed-{impl}"
    AttentionInterface.register(name, recomputed)
    model.set_attn_implementation(name)
    return f"Megatron's selective recomputation: the {impl} attention function under torch.utils.checkpoint"


def _apply_titan(model, blocks, kind, every, autocast, titan):
    """torchtitan's own functions, on each block in order, with its defaults (its
    ``ActivationCheckpoint`` config as torchtitan reads it, no torch.compile)."""
    ac, config_cls, save_list, version = titan
    config = config_cls(mode="selective", selective_ac_option="op" if every is None else str(every))
    ac._layer_sac_count = 0  # torchtitan's global counter, as in a fresh process
    wrappers = {}
    for i, b in enumerate(blocks):
        if kind == "selective-op":
            w = ac._apply_op_sac(b, config, base_fqn=f"layers.{i}", op_sac_save_list=save_list)
            # Its checkpoint_fn is a partial over torch's checkpoint: its context_fn joined with
            # the emulated autocast's recomputation where there is one.
            fn = w.checkpoint_fn
            w.checkpoint_fn = functools.partial(
                fn, context_fn=_with_recompute_context(fn.keywords["context_fn"], autocast)
            )
        else:
            w = ac._apply_layer_sac(b, config)
        if w is not b:
            parent, name = _parent_of(model, b)
            parent.register_module(name, w)
            wrappers[b] = w
    return wrappers, f"torchtitan {version}'s own {kind} policy"
