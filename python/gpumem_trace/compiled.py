"""``torch.compile`` of a training job's loss (``--compile``), as its memory comes out of
Inductor.

A compiled function's memory is decided in two steps, both of which the trace takes as
PyTorch's compiler takes them. First AOTAutograd splits the function's joint forward and
backward into two graphs with the min-cut partitioner and Inductor's decompositions (as
``torch.compile``'s default backend does): what the forward keeps for the backward is the
partitioner's choice (for a cross-entropy: the row maxima and log-sums, not the fp32
log-probabilities eager autograd keeps). The graphs are made by PyTorch's own ``aot_function`` on
fake tensors of the call's shapes, once per shape.

Then Inductor fuses the graphs' pointwise ops and reductions into kernels, and only some of
their results are buffers in GPU memory; the rest live in registers inside a kernel. The trace
runs each graph op by op and counts as memory exactly what Inductor realises as a buffer: each
graph's outputs (the forward's kept tensors and results, the backward's gradients), each
reduction's result, and the inputs of the ops Inductor calls as kernels of their own (matmuls,
attention, collectives: anything not pointwise, a reduction, an indexing or a view). Constants
are computed where they are read, and so is a one-hot scattered into one (Inductor's
``scatter_upon_const_tensor`` pass makes a cross-entropy's backward pointwise). A buffer is
freed after its last reader, as Inductor's generated code deletes it. Not modelled:
Inductor's heuristics that realise a pointwise value read many times, and its kernels' own
scratch space.

Only what the trainer compiles as a function of tensors is taken this way: the loss (torchtitan's
``compile.components = ["loss"]``, torchtune's ``compile_loss``, a Hugging Face model's
``loss_function`` as a whole-model compile computes it). A compiled model's blocks are traced
eagerly.
"""

import contextlib

import torch
import torch.fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from .models import ReferenceError_
from .tracer import in_registers

aten = torch.ops.aten

# Reductions: Inductor makes each result a buffer of its own (small: a row's maximum or sum).
_REDUCTIONS = {
    aten.sum,
    aten.mean,
    aten.amax,
    aten.amin,
    aten.max,
    aten.min,
    aten.argmax,
    aten.argmin,
    aten.prod,
    aten.var,
    aten.var_mean,
    aten.any,
    aten.all,
    aten.logsumexp,
}
# Ops Inductor computes inside the kernel that reads them: constants, indexed loads and copies.
_INLINED = {
    aten.full,
    aten.full_like,
    aten.zeros,
    aten.zeros_like,
    aten.ones,
    aten.ones_like,
    aten.scalar_tensor,
    aten.arange,
    aten.gather,
    aten.index,
    aten.clone,
    aten._to_copy,
}
_CONSTANTS = {aten.full, aten.zeros, aten.scalar_tensor}


def _packet(node):
    return getattr(node.target, "overloadpacket", None)


def _is_view(node):
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def _fused(node):
    """Whether Inductor computes ``node`` inside a fused kernel (rather than calling a kernel
    of its own for it, whose inputs must then be in memory)."""
    if node.op != "call_function":
        return False
    packet = _packet(node)
    if packet in _REDUCTIONS or packet in _INLINED or _is_view(node):
        return True
    if packet is aten.scatter:  # scatter into a constant: a pointwise select (see above)
        base = node.args[0]
        return isinstance(base, torch.fx.Node) and _packet(base) in _CONSTANTS
    return torch.Tag.pointwise in getattr(node.target, "tags", ())


def _inputs(node):
    return [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.fx.Node)]


class _Plan:
    """One graph and which of its values are buffers; run it on the trace's tensors."""

    def __init__(self, gm, device):
        self.nodes = list(gm.graph.nodes)
        self.device = device
        memory = set()
        for node in reversed(self.nodes):
            if node.op == "output":
                memory.update(_inputs(node))
            elif node.op == "call_function":
                if not _fused(node):
                    memory.update(_inputs(node))
                elif _packet(node) in _REDUCTIONS:
                    memory.add(node)
                elif _is_view(node) and node in memory:
                    memory.update(_inputs(node)[:1])  # a view in memory is its base's memory
        self.in_memory = memory
        last_use = {}
        for node in self.nodes:
            for arg in _inputs(node):
                last_use[arg] = node
        self.freed_after = {}  # node -> the values its run is the last reader of
        for value, node in last_use.items():
            self.freed_after.setdefault(node, []).append(value)

    def run(self, inputs):
        env, feed = {}, iter(inputs)
        look = lambda a: env[a] if isinstance(a, torch.fx.Node) else a
        for node in self.nodes:
            if node.op == "placeholder":
                env[node] = next(feed)
            elif node.op == "call_function":
                args = pytree.tree_map(look, tuple(node.args))
                kwargs = pytree.tree_map(look, dict(node.kwargs))
                if "device" in kwargs:  # the graphs were made on the host's fake tensors
                    kwargs["device"] = self.device
                fused = node not in self.in_memory
                with in_registers() if fused else contextlib.nullcontext():
                    env[node] = node.target(*args, **kwargs)
            elif node.op == "output":
                return tuple(pytree.tree_map(look, node.args[0]))
            else:
                raise ReferenceError_(f"--compile: a compiled graph holds `{node.op}` nodes")
            for value in self.freed_after.get(node, ()):
                env.pop(value, None)
        raise ReferenceError_("--compile: a compiled graph without an output")


class _Graphs:
    """A function's forward and backward graphs at one set of input shapes."""

    def __init__(self, forward, backward, spec, device):
        self.forward = _Plan(forward, device)
        self.backward = _Plan(backward, device) if backward is not None else None
        self.spec = spec  # the function's outputs, the forward graph's first
        self.outputs = spec.num_leaves


class _Run(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graphs, *args):
        out = graphs.forward.run(args)
        ctx.graphs, ctx.kept = graphs, out[graphs.outputs :]
        return out[: graphs.outputs]

    @staticmethod
    def backward(ctx, *grads):
        kept, ctx.kept = ctx.kept, None  # freed as the backward frees what it saved
        return (None, *ctx.graphs.backward.run((*kept, *grads)))


def _capture(fn, args, training):
    """The forward and backward graphs ``aot_function`` makes of ``fn`` at ``args``' shapes,
    on fake host tensors outside the trace (its recording modes off)."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        from torch._functorch.aot_autograd import make_boxed_func
    except ImportError:  # older torch
        from functorch.compile import make_boxed_func

    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    compiled = aot_function(
        fn,
        keep,
        keep,
        partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
    )
    # The graphs are made on the host: CUDA is not asked, even where library code is shown a GPU
    # (the stand-in CUDA of a Trainer's evaluation; AOTAutograd saves CUDA's RNG state where
    # CUDA says it is available).
    available, torch.cuda.is_available = torch.cuda.is_available, lambda: False
    try:
        with _disable_current_modes(), FakeTensorMode(allow_non_fake_inputs=False):
            fakes = [
                torch.empty_strided(
                    a.shape, a.stride(), dtype=a.dtype, device="cpu"
                ).requires_grad_(a.requires_grad and training)
                for a in args
            ]
            with torch.set_grad_enabled(training):
                out, spec = pytree.tree_flatten(compiled(*fakes))
                differentiable = [o for o in out if isinstance(o, torch.Tensor) and o.requires_grad]
                if differentiable:
                    torch.autograd.backward(
                        differentiable, [torch.ones_like(o) for o in differentiable]
                    )
    finally:
        torch.cuda.is_available = available
    return graphs, spec


class Compiled:
    """``fn`` as ``torch.compile`` runs it, memory-wise (see the module's text)."""

    def __init__(self, fn):
        self.fn = fn
        self.graphs = {}

    def __call__(self, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        tensors = [leaves[i] for i in at]
        statics = [None if i in at else repr(x) for i, x in enumerate(leaves)]

        def pure(*ts):
            whole = list(leaves)
            for i, t in zip(at, ts):
                whole[i] = t
            a, kw = pytree.tree_unflatten(whole, spec)
            return self.fn(*a, **kw)

        training = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        key = (
            str(spec),
            tuple(statics),
            training,
            tuple((tuple(t.shape), t.stride(), t.dtype, t.requires_grad) for t in tensors),
        )
        graphs = self.graphs.get(key)
        if graphs is None:
            found, out_spec = _capture(pure, tensors, training)
            if len(found) != (2 if training else 1):
                raise ReferenceError_(
                    f"--compile: {getattr(self.fn, '__name__', self.fn)} did not compile to "
                    "one forward and one backward graph"
                )
            device = tensors[0].device if tensors else torch.device("cpu")
            graphs = _Graphs(found[0], found[1] if training else None, out_spec, device)
            self.graphs[key] = graphs
        if graphs.backward is None:
            out = graphs.forward.run(tensors)
        else:
            out = _Run.apply(graphs, *tensors)
        out = out if isinstance(out, tuple) else (out,)
        return pytree.tree_unflatten(list(out[: graphs.outputs]), graphs.spec)


@contextlib.contextmanager
def torch_compile():
    """``torch.compile`` as trainer code calls it on a function (torchtitan's loss, torchtune's
    ``compile_loss``): that function, compiled as above."""
    real = torch.compile

    def compile_(model=None, **_options):
        if model is None:  # used as a decorator factory
            return lambda fn: Compiled(fn)
        if isinstance(model, torch.nn.Module) and any(True for _ in model.parameters()):
            # Its parameters would be the graphs' constants, not inputs with gradients.
            raise ReferenceError_(
                "--compile: the trainer compiles a module with parameters; gpumem models a "
                "compiled loss"
            )
        return Compiled(model)  # a function, or a loss module (no parameters)

    torch.compile = compile_
    try:
        yield
    finally:
        torch.compile = real


def compile_loss(job, model, ref):
    """``job``'s loss compiled as its trainer compiles it: the trainer's own compile where it
    compiles a loss of its own (torchtitan's, torchtune's; None returned), else the loss a
    Hugging Face model's forward computes (its ``loss_function``, which a whole-model compile
    fuses): that ``Compiled``, which the loop checks was called (a forward may compute its loss
    without it)."""
    if job.compile_loss is not None:
        job.compile_loss(torch_compile)
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if isinstance(getattr(type(base), "loss_function", None), property):
        base.loss_function = Compiled(base.loss_function)
        return base.loss_function
    raise ReferenceError_(
        f"{ref}: --compile models a compiled loss: torchtitan's and torchtune's (--chunked-ce), "
        "or a Hugging Face model's loss_function; this model has none of them"
    )
