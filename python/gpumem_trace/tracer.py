"""Recording storages and kernels as gpumem trace events."""

import contextlib
import contextvars
import json
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .sdpa import KERNEL_BUFFERS

try:
    from torch.distributed.tensor import DTensor as _DTENSOR
except ImportError:  # a torch built without distributed
    _DTENSOR = None

try:
    from torch._subclasses.fake_tensor import FakeTensor as _FAKE
except ImportError:  # older torch
    _FAKE = None


def _faking():
    """Whether a FakeTensorMode is active (its factories reach the modes below it)."""
    key = getattr(torch._C, "_TorchDispatchModeKey", None)
    return key is not None and torch._C._get_dispatch_mode(key.FAKE) is not None


try:
    from torch.utils.flop_counter import flop_registry
except ImportError:  # older torch
    flop_registry = {}

aten = torch.ops.aten

# Ops that call cuBLAS: the first one on a thread allocates that thread's workspace.
CUBLAS_OPS = {
    aten.mm,
    aten.addmm,
    aten.bmm,
    aten.baddbmm,
    aten.addbmm,
    aten.addmv,
    aten.mv,
    aten.addr,
    aten.dot,
    aten.vdot,
}
CUBLAS_WORKSPACE_BYTES = 8_519_680  # resized per GPU by gpumem's replay
# A matmul with a fused bias (addmm with a 1-D bias: linear in forward) runs through cuBLASLt,
# whose workspace the thread also keeps; sized by the replay from the profile (probed).
CUBLASLT_WORKSPACE_BYTES = 1 << 20

# Set while a compiled kernel's intermediates are computed (compiled.py): the tensors made then
# stand for values the fused kernel keeps in registers, no memory, and their ops for no kernel.
_IN_REGISTERS = contextvars.ContextVar("gpumem_in_registers", default=False)


@contextlib.contextmanager
def in_registers():
    """Tensors made inside hold no GPU memory, and ops run inside are no kernels of their own:
    a fused kernel's intermediates."""
    token = _IN_REGISTERS.set(True)
    try:
        yield
    finally:
        _IN_REGISTERS.reset(token)


DEFAULT_CATEGORY = {
    "setup": "parameter",
    "forward": "activation",
    "backward": "temporary",
    "optimizer": "temporary",
    "zero_grad": "temporary",
}


class Recorder:
    """The event list of one trace. Storage keys are mapped to fresh ids, so reused addresses
    never confuse lifetimes."""

    def __init__(self):
        self.events = []
        self.live = {}  # storage key -> (id, index of its alloc event)
        self.next_id = 1
        self.phase = "setup"
        self.category = None  # overrides the phase's default category
        # The stream new storages are made on (0: the default; FSDP2's own streams get their
        # own pools in the caching allocator, as on a GPU).
        self.stream = 0
        self.op_name = None  # overrides the op that made an allocation (a wrapper's buffer)
        self.untracked = set()  # storage keys whose memory a wrapper accounts for itself
        self.iterations = 0
        self.closed = False
        self.workspaces = set()
        self.kernels = True  # off during validation: utilization is the training step's
        self.host = (
            False  # what runs now runs on the host (CPU offload): its memory is not the GPU's
        )
        self.sized_by_parameters = set()  # see parameter_sized
        # The process groups this rank's collectives ran on, by name: their ranks (each is an
        # NCCL communicator on a GPU, whose buffers live outside the allocator).
        self.communicators = {}
        # Storage keys of meta tensors that stand for no memory at all (see storageless).
        self.no_memory = set()
        self.making_no_memory = False

    def alloc(self, key, nbytes, op, category=None, module=""):
        i = self.next_id
        self.next_id += 1
        cat = category or self.category or DEFAULT_CATEGORY[self.phase]
        e = {
            "ev": "alloc",
            "id": i,
            "bytes": int(nbytes),
            "category": cat,
            "phase": self.phase,
            "op": self.op_name or op,
        }
        if module:
            e["module"] = module
        if self.stream:
            e["stream"] = self.stream
        self.events.append(e)
        if key is not None:
            self.live[key] = (i, len(self.events) - 1)
        return i

    @contextlib.contextmanager
    def parameter_sized(self, op):
        """Allocations made inside are a wrapper's own, sized from the parameters and its config
        alone, never from the batch: made by ``op``, which the header lists in
        ``sized_by_parameters``."""
        saved = self.op_name
        self.op_name = op
        self.sized_by_parameters.add(op)
        try:
            yield
        finally:
            self.op_name = saved

    def free(self, key):
        if self.closed:
            return
        entry = self.live.pop(key, None)
        if entry is not None:
            self.events.append({"ev": "free", "id": entry[0]})

    def transient(self, nbytes, op, module=""):
        """A buffer a kernel allocates and frees before it returns."""
        if nbytes > 0:
            i = self.alloc(None, nbytes, op, category="temporary", module=module)
            self.events.append({"ev": "free", "id": i})

    @contextlib.contextmanager
    def labelled(self, category):
        """What is allocated within is ``category`` (a whole run's staged weights, the state a
        resume reads in, a checkpoint's gathered copies), whatever the phase's default."""
        saved, self.category = self.category, category
        try:
            yield
        finally:
            self.category = saved

    @contextlib.contextmanager
    def on_host(self):
        """Work the host does (FSDP2's CPU offload): the tensors it makes are meta tensors here,
        as every tensor is, but hold host memory, and its ops are no GPU kernels."""
        saved = self.host, self.kernels
        self.host, self.kernels = True, False
        try:
            yield
        finally:
            self.host, self.kernels = saved

    @contextlib.contextmanager
    def storageless(self):
        """Tensors made inside are meta tensors as library code means them (a model's skeleton
        before its weights load, accelerate's offloaded weights): no memory anywhere, and what
        is computed from them alone holds none either (the stand-in CUDA, standin.py)."""
        saved, self.making_no_memory = self.making_no_memory, True
        try:
            yield
        finally:
            self.making_no_memory = saved

    def op(self, name, flops, bytes_read, bytes_written):
        if not self.kernels or _IN_REGISTERS.get():  # a fused kernel's part: no kernel of its own
            return
        self.events.append(
            {
                "ev": "op",
                "op": name,
                "flops": int(flops),
                "bytes_read": int(bytes_read),
                "bytes_written": int(bytes_written),
            }
        )

    def run_phase(self, name):
        """The events that follow belong to part ``name`` of the whole run (load, train,
        evaluate, save)."""
        self.events.append({"ev": "run_phase", "name": name})

    def empty_cache(self):
        """``torch.cuda.empty_cache()``: the allocator gives back its unused cached segments."""
        self.events.append({"ev": "empty_cache"})

    def iteration_end(self):
        self.events.append({"ev": "iteration", "index": self.iterations})
        self.iterations += 1

    def repeat_last_iteration(self):
        """Appends a copy of the last iteration as the next one where the loop has reached its
        steady state, so that it need not be run: every tensor older than the last iteration
        that it freed was made by the iteration before (not by the setup), and those tensors
        match one for one — by size, category, phase, op and module, in the order they were
        made — the tensors the last iteration made that outlive it, which the copy frees where
        the last iteration freed their counterparts. Returns False, appending nothing, where
        that does not hold (DDP's second iteration frees the buckets its setup made, to
        rebuild them): the caller runs the iteration."""
        marks = [i for i, e in enumerate(self.events) if e["ev"] == "iteration"]
        if len(marks) < 2 or marks[-1] != len(self.events) - 1:
            return False
        before, start, end = (marks[-3] if len(marks) > 2 else -1), marks[-2] + 1, marks[-1]
        made = {}  # id -> (index of its alloc, its alloc event)
        for i, e in enumerate(self.events):
            if e["ev"] == "alloc":
                made[e["id"]] = (i, e)
        shape = lambda e: (e["bytes"], e["category"], e["phase"], e["op"], e.get("module"))
        last = self.events[start:end]
        freed_older, freed_here = [], set()
        for e in last:
            if e["ev"] == "free":
                at, alloc = made[e["id"]]
                if at >= start:
                    freed_here.add(e["id"])
                elif at > before and alloc["phase"] != "setup":
                    freed_older.append((at, e["id"]))
                else:
                    return False
        outliving = [
            e for e in last if e["ev"] == "alloc" and e["id"] not in freed_here
        ]  # in the order made
        by_shape = {}
        for e in outliving:
            by_shape.setdefault(shape(e), []).append(e["id"])
        heir = {}  # an older tensor -> the last iteration's tensor the copy frees in its place
        for _, i in sorted(freed_older):
            same = by_shape.get(shape(made[i][1]))
            if not same:
                return False
            heir[i] = same.pop(0)
        if any(by_shape.values()):
            return False
        renamed = {}
        for e in last + [self.events[end]]:
            e = dict(e)
            if e["ev"] == "alloc":
                renamed[e["id"]] = e["id"] = self.next_id
                self.next_id += 1
            elif e["ev"] == "free":
                e["id"] = renamed.get(e["id"]) or heir[e["id"]]
            elif e["ev"] == "iteration":
                e["index"] = self.iterations
                self.iterations += 1
            self.events.append(e)
        return True

    def relabel(self, tensor, category):
        """Gives the allocation holding ``tensor`` a category known only later (p.grad, state)."""
        entry = self.live.get(storage_key(tensor))
        if entry is not None:
            self.events[entry[1]]["category"] = category

    def conv_workspace(self, direction, config, n, module=""):
        """A workspace cuDNN's engine takes and gives back inside a convolution kernel. Its size
        depends on the GPU and library, so the trace names the convolution (`config`, batch
        `n` apart so batch-symbolic traces keep one key) and gpumem's replay sizes it from the
        profile's workspace table."""
        e = {"ev": "workspace", "pass": direction, "conv": config, "n": int(n), "phase": self.phase}
        if module:
            e["module"] = module
        self.events.append(e)

    def workspace(self, thread, lt=False):
        """The first cuBLAS (or cuBLASLt) call on a thread allocates the workspace it keeps."""
        if (thread, lt) not in self.workspaces:
            self.workspaces.add((thread, lt))
            if lt:
                self.alloc(
                    None, CUBLASLT_WORKSPACE_BYTES, "cublaslt_workspace", category="workspace"
                )
            else:
                self.alloc(None, CUBLAS_WORKSPACE_BYTES, "cublas_workspace", category="workspace")

    def write(self, path, header):
        self.closed = True
        header = dict(header, format="gpumem-trace", version=2, iterations=self.iterations)
        line = _event_encoder()
        with open(path, "w") as f:
            f.write(json.dumps(header) + "\n")
            f.writelines(line(e) + "\n" for e in self.events)


def _event_encoder():
    """A function from an event to its JSON line. ``json``'s C encoder, made once: encoding a
    trace's events one ``JSONEncoder.encode`` at a time (which makes that encoder anew for each)
    was a tenth of a trace's time. The same text; the public path where the C encoder is absent."""
    encoder = json.JSONEncoder(separators=(",", ":"))
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return encoder.encode
    encode = make(
        None,
        encoder.default,
        json.encoder.encode_basestring_ascii,
        None,
        ":",
        ",",
        False,
        False,
        True,
    )
    return lambda e: "".join(encode(e, 0))


# A convolution's passes, as the workspace table names them.
CONV_FORWARD, CONV_BACKWARD_DATA, CONV_BACKWARD_FILTER = "fwd", "bwd_data", "bwd_filter"


def conv_config(x, w, stride, padding, dilation, transposed, output_padding, groups):
    """The key of a convolution in a profile's workspace table, without the batch (``n``):
    what cuDNN's engine choice depends on. ``in`` is one sample's shape (C×spatial), ``w`` the
    weight's; layout is channels_last where PyTorch's cuDNN path would use it (input or weight
    in that format)."""
    dims = lambda v: "x".join(str(int(i)) for i in v)
    last = any(_channels_last(t) for t in (x, w))
    parts = [
        f"in={dims(x.shape[1:])}",
        f"w={dims(w.shape)}",
        f"stride={dims(stride)}",
        f"pad={dims(padding)}",
        f"dil={dims(dilation)}",
        f"groups={int(groups)}",
        f"dtype={str(x.dtype).removeprefix('torch.')}",
        f"layout={'channels_last' if last else 'contiguous'}",
    ]
    if transposed:
        parts.append(f"transposed=1;opad={dims(output_padding)}")
    return ";".join(parts)


def _channels_last(t):
    if t.dim() == 4:
        return not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)
    if t.dim() == 5:
        return not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last_3d)
    return False


def _local(t):
    """The tensor whose memory ``t`` is: a DTensor's (FSDP2's sharded parameters, gradients and
    optimizer state) is its local shard."""
    return getattr(t, "_local_tensor", t)


def storage_key(t):
    return _local(t).untyped_storage()._cdata


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield _local(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _nbytes(x):
    return sum(t.numel() * t.element_size() for t in _tensors(x))


# The autograd node being run (torch >= 2.1; on older ones backward allocations name no module).
_current_autograd_node = getattr(torch._C, "_current_autograd_node", lambda: None)


class ModulePaths(TorchFunctionMode):
    """Which module an allocation belongs to, by its path in ``named_modules()``. In forward it is
    the innermost module whose forward is running (global module hooks keep the stack). In
    backward it is the module whose forward created the autograd node being run: this mode
    tags every node with the module path as the node is created."""

    KEY = "gpumem_module"

    def __init__(self, model):
        super().__init__()
        # The root's own code (a loss computed in forward) is named by its class.
        self.names = {id(m): n or type(model).__name__ for n, m in model.named_modules()}
        self.stack = []
        self.handles = []

    def __enter__(self):
        hooks = torch.nn.modules.module
        try:
            # Also when forward raises: checkpointing's recomputation stops early by raising
            # inside the last module it needs, which must not stay on the stack.
            leave = hooks.register_module_forward_hook(self._leave_module, always_call=True)
        except TypeError:  # torch < 2.1
            leave = hooks.register_module_forward_hook(self._leave_module)
        self.handles = [hooks.register_module_forward_pre_hook(self._enter_module), leave]
        return super().__enter__()

    def _enter_module(self, module, inputs):
        # A module outside the model (a loss module) belongs to whoever called it.
        self.stack.append(self.names.get(id(module), self.top()))

    def _leave_module(self, module, inputs, output):
        if self.stack:
            self.stack.pop()

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return super().__exit__(*exc)

    def top(self):
        return self.stack[-1] if self.stack else ""

    def current(self):
        """The module of the op running now. Forward code running inside backward (activation
        checkpointing's recomputation) has a stack of its own."""
        if self.stack:
            return self.stack[-1]
        node = _current_autograd_node()
        return node.metadata.get(self.KEY, "") if node is not None else ""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            self._tag(t.grad_fn, self.top())
        return out

    def _tag(self, node, path):
        """Tags ``node`` and the untagged nodes behind it: those a composite function (say
        cross_entropy's log_softmax) made inside the call. Every call's outputs are tagged as
        they appear (outside any module with ""), so the walk stops at the call's inputs."""
        todo = [node]
        while todo:
            n = todo.pop()
            if n is None or self.KEY in n.metadata:
                continue
            n.metadata[self.KEY] = path
            todo.extend(f for f, _ in n.next_functions)


class TraceMode(TorchDispatchMode):
    """Sees every ATen op below autograd; records new device storages and their deaths."""

    def __init__(
        self, recorder, modules, device="meta", dtensor_dispatch=False, routing=None, unwrapped=()
    ):
        super().__init__()
        self.r = recorder
        # A mixture-of-experts router's stand-in counts (routing.Routing), or None.
        self.routing = routing
        self.device = device
        self.modules = modules
        self.last_op = None
        self.memo = META_MEMO if device == "meta" else None
        # Tensor parallelism's DTensors redistribute inside their own dispatch: see there.
        self.dtensor_dispatch = dtensor_dispatch and _DTENSOR is not None
        # Tensor subclasses whose own dispatch runs each op on their inner tensors (torchao's
        # float8 casts): traced there, where their memory is.
        self.unwrapped = tuple(unwrapped)

    def track(self, t, op):
        if t.device.type != self.device:
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self.r.live or key in self.r.untracked or st.nbytes() == 0:
            return
        if self.r.host or _IN_REGISTERS.get():
            # The host's memory, or none; the key is the GPU's again once the storage dies.
            self.r.untracked.add(key)
            weakref.finalize(st, self.r.untracked.discard, key)
            return
        if self.r.making_no_memory:
            if key not in self.r.no_memory:
                self.r.no_memory.add(key)
                weakref.finalize(st, self.r.no_memory.discard, key)
            return
        self.r.alloc(key, st.nbytes(), op, module=self.modules.current())
        weakref.finalize(st, self.r.free, key)

    def _communicator(self, func, args, kwargs):
        """Notes the process group a collective runs on (c10d's ops take the group, the
        functional ones its name)."""
        for i, a in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(a.name)
            if a.name == "process_group" and value is not None:
                # The dispatcher hands the group over as its TorchScript object.
                pg = torch.distributed.ProcessGroup
                group = value if isinstance(value, pg) else pg.unbox(value)
            elif a.name == "group_name" and isinstance(value, str):
                from torch.distributed.distributed_c10d import _resolve_process_group

                group = _resolve_process_group(value)
            else:
                continue
            if group.size() > 1:
                self.r.communicators[group.group_name] = group.size()
            return

    def _from_no_memory(self, args):
        """Whether an op reads a tensor that stands for no memory and none the GPU holds."""
        keys = [t.untyped_storage()._cdata for t in _tensors(args) if t.device.type == self.device]
        return any(k in self.r.no_memory for k in keys) and not any(k in self.r.live for k in keys)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in _COLLECTIVES:
            self._communicator(func, args, kwargs or {})
        if _FAKE is not None and (any(issubclass(t, _FAKE) for t in types) or _faking()):
            # A FakeTensorMode's own computation (DTensor's sharding propagation runs each op
            # once on fake tensors of the global shape to learn its output's, making them with
            # factories that take no tensor): no memory, no kernel.
            return func(*args, **(kwargs or {}))
        if self.unwrapped and any(issubclass(t, self.unwrapped) for t in types):
            return NotImplemented
        if self.dtensor_dispatch and any(issubclass(t, _DTENSOR) for t in types):
            # A tensor-parallel DTensor: its own dispatch runs the op on the rank's local
            # tensors, and redistributes them first where the layouts ask — those ops come back
            # here, in the rank's shapes. (FSDP2's shards alone need none of this: their ops
            # run as one, output tracked by its local tensor, as the FSDPMemTracker comparison
            # and the cut traces' periodicity were measured.)
            return NotImplemented
        kwargs = kwargs or {}
        if self.r.no_memory and not self.r.making_no_memory and self._from_no_memory(args):
            with self.r.storageless():
                return self.__torch_dispatch__(func, types, args, kwargs)
        if in_place_on_gpu(func, args, kwargs, self.r.phase, self.last_op):
            # While a Python dispatch mode is active, PyTorch treats every tensor as a subclass
            # (`isTensorSubclassLike`) and takes out-of-place paths: the autograd engine sums
            # two gradients of one tensor out of place, and linear adds its bias out of place.
            # On a GPU both happen in place; an alias of the first operand is the same memory.
            self.r.op("add_", 0, _nbytes(args), 0)
            if self.r.phase == "forward":
                self.r.workspace("main", lt=True)  # linear's bias: addmm, through cuBLASLt
            return aten.alias(args[0])
        copy = func is aten.copy_.default
        to_host = (
            (copy or func is aten._to_copy.default)
            and args[1 if copy else 0].device.type == self.device
            and (
                args[0].device.type == "cpu"
                if copy
                else torch.device(kwargs.get("device") or self.device).type == "cpu"
            )
        )
        if to_host and self.routing is not None:
            # A router's counts read on the host: their stand-in values.
            counts = self.routing.on_host(args[1 if copy else 0])
            if counts is not None:
                if copy:
                    return args[0].copy_(counts)
                return counts.to(kwargs.get("dtype") or counts.dtype)
        if self.routing is not None and func is aten._local_scalar_dense.default:
            value = self.routing.scalar(args[0])
            if value is not None:
                return value
        if to_host and func is aten._to_copy.default:
            # Sent to the host (FSDP2's offloaded gradients): host memory, a meta tensor here.
            out = torch.empty(
                args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype, device=args[0].device
            )
            with self.r.on_host():
                self.track(out, "_to_copy")
            return out
        out, remembered = data_dependent(func, args, kwargs), None
        if out is NotImplemented and self.memo is not None:
            out, remembered = self.memo.run(func, args, kwargs)
        if out is NotImplemented:
            try:
                out = func(*args, **kwargs)
            except RuntimeError:
                # CUDA kernels take CPU scalars (`x.masked_fill(m, torch.tensor(v))`); meta ones
                # do not: give them the scalars on meta.
                on_meta = lambda x: (
                    x.to(self.device)
                    if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() == 0
                    else x
                )
                moved = (
                    tuple(on_meta(a) for a in args),
                    {k: on_meta(v) for k, v in kwargs.items()},
                )
                if all(x is y for x, y in zip(moved[0], args)) and all(
                    moved[1][k] is kwargs[k] for k in kwargs
                ):
                    raise
                out = func(*moved[0], **moved[1])
        if self.routing is not None:
            self.routing.after(func, args, kwargs, out)
        name = func.overloadpacket.__name__
        if name not in VIEW_OPS:
            self.last_op = name
        if func.overloadpacket is aten.convolution:
            for t in _tensors(out):
                self.track(t, name)
            self.r.conv_workspace(
                CONV_FORWARD,
                conv_config(*args[:2], *args[3:9]),
                args[0].shape[0],
                self.modules.current(),
            )
        elif func.overloadpacket is aten.convolution_backward:
            # cuDNN's backward makes grad_input and then runs its kernel (taking and giving
            # back that pass's workspace), then the same for grad_weight; grad_bias last.
            config = conv_config(*args[1:3], *args[4:10])
            module = self.modules.current()
            mask = args[10]
            for i, direction in ((0, CONV_BACKWARD_DATA), (1, CONV_BACKWARD_FILTER)):
                if out[i] is not None:
                    self.track(out[i], name)
                if mask[i]:
                    self.r.conv_workspace(direction, config, args[1].shape[0], module)
            if out[2] is not None:
                self.track(out[2], name)
        else:
            for t in _tensors(out):
                self.track(t, name)
        buffers = KERNEL_BUFFERS.get(func.overloadpacket)
        if buffers is not None:
            for nbytes in buffers(args, out):
                self.r.transient(nbytes, name, self.modules.current())
        if func.overloadpacket in CUBLAS_OPS:
            thread = "autograd" if self.r.phase == "backward" else "main"
            self.r.workspace(thread)
            if (
                func.overloadpacket is aten.addmm
                and isinstance(args[0], torch.Tensor)
                and args[0].dim() == 1
            ):
                self.r.workspace(thread, lt=True)
        costs = remembered[2] if remembered is not None else None
        if costs is None:
            flops = 0
            f = flop_registry.get(func.overloadpacket)
            if f is not None:
                try:
                    flops = f(*args, **kwargs, out_val=out)
                except Exception:
                    flops = 0
            costs = (flops, _nbytes(args), _nbytes(out))
            if remembered is not None:
                remembered[2] = costs
        self.r.op(name, *costs)
        return out


class MetaMemo:
    """The outputs of ops on meta tensors, by their inputs' metadata. A meta kernel (many are
    PyTorch's Python references) computes only its outputs' shapes, strides and dtypes, yet it
    is most of a trace's time; a model's layers run the same ops on the same shapes, so each
    is computed once and its outputs made directly after that. Only ops whose outputs are new
    tensors (no aliasing or mutation in their schema, no output shape that depends on values)
    on meta inputs are remembered, and only where each output owns exactly its own storage."""

    def __init__(self):
        # key -> [tree spec, [(size, stride, dtype) or None], the op's costs or None], or None
        # where the outputs cannot be made directly (the op is run).
        self.outputs = {}
        self.fresh = {}  # op -> whether its schema makes new tensors only

    def run(self, func, args, kwargs):
        """The op's outputs, remembered or computed (and remembered), and the memo's entry for
        them, whose costs (flops, bytes read and written: functions of the same metadata) the
        caller fills in once; ``(NotImplemented, None)`` where the op or its inputs cannot be
        remembered."""
        fresh = self.fresh.get(func)
        if fresh is None:
            fresh = self.fresh[func] = _makes_fresh_tensors(func)
        if not fresh:
            return NotImplemented, None
        try:
            key = (func, torch.get_default_dtype(), _meta_key(args), _meta_key(kwargs))
        except _Unkeyable:
            return NotImplemented, None
        if key in self.outputs:
            entry = self.outputs[key]
            if entry is None:
                return NotImplemented, None
            spec, leaves, _ = entry
            return pytree.tree_unflatten(
                [
                    None
                    if m is None
                    else torch.empty_strided(m[0], m[1], dtype=m[2], device="meta")
                    for m in leaves
                ],
                spec,
            ), entry
        out = func(*args, **kwargs)
        entry = self.outputs[key] = _fresh_outputs(out, args)
        return out, entry


# One per process: its keys are all an output depends on, so every trace (each batch size and
# depth of a request) shares what the others computed.
META_MEMO = MetaMemo()


class _Unkeyable(Exception):
    pass


_PLAIN = (
    int,
    float,
    bool,
    str,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)


def _meta_key(x):
    """What an op's result on meta tensors can depend on: each tensor's metadata (values only
    where the argument is not a tensor). Types are kept (``x + 1`` and ``x + 1.0`` differ)."""
    t = type(x)
    if t is torch.Tensor or t is torch.nn.Parameter:
        if x.device.type != "meta" or x.layout != torch.strided:
            raise _Unkeyable
        return (x.dtype, tuple(x.shape), x.stride(), x.storage_offset(), x.is_conj(), x.is_neg())
    if t in _PLAIN:
        return (t, x)
    if t is list or t is tuple or t is torch.Size:
        return (t, tuple(_meta_key(y) for y in x))
    if t is dict:
        return tuple((k, _meta_key(v)) for k, v in sorted(x.items()))
    raise _Unkeyable


def _makes_fresh_tensors(func):
    schema = getattr(func, "_schema", None)
    if schema is None or schema.is_mutable:
        return False
    if any(a.alias_info is not None for a in schema.arguments) or any(
        r.alias_info is not None for r in schema.returns
    ):
        return False
    tags = getattr(func, "tags", ())
    return not any(
        getattr(torch.Tag, t, None) in tags
        for t in ("dynamic_output_shape", "data_dependent_output")
    )


def _fresh_outputs(out, args):
    """``out`` as the memo keeps it, or None where its outputs are not plain meta tensors each
    with a storage of its own that ``torch.empty_strided`` would make."""
    leaves, spec = pytree.tree_flatten(out)
    seen = {storage_key(t) for t in _tensors(args)}
    kept = []
    for t in leaves:
        if t is None:
            kept.append(None)
            continue
        if (
            type(t) is not torch.Tensor
            or t.device.type != "meta"
            or t.layout != torch.strided
            or t.storage_offset() != 0
        ):
            return None
        key = storage_key(t)
        span = 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        if key in seen or t.untyped_storage().nbytes() != span * t.element_size():
            return None
        seen.add(key)
        kept.append((tuple(t.shape), t.stride(), t.dtype))
    return [spec, kept, None]


VIEW_OPS = {
    "view",
    "_unsafe_view",
    "t",
    "transpose",
    "unsqueeze",
    "squeeze",
    "permute",
    "expand",
    "alias",
    "detach",
    "select",
    "slice",
}


def in_place_on_gpu(func, args, kwargs, phase, last_op):
    """An out-of-place add that a GPU run does in place: the autograd engine's sum of two
    same-shaped gradients (InputBuffer::accumulate), or linear's bias added to a fresh matmul
    output."""
    if func is not aten.add.Tensor or len(args) != 2 or kwargs.get("alpha", 1) != 1:
        return False
    a, b = args
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if phase == "backward":
        return a.shape == b.shape and a.dtype == b.dtype and _dense(a) and _dense(b)
    return (
        phase == "forward"
        and last_op in ("mm", "bmm")
        and b.dim() == 1
        and b.requires_grad
        and a.dim() >= 2
        and a.shape[-1] == b.shape[0]
        and a.dtype == b.dtype
        and a.is_contiguous()
    )


def _dense(t):
    """Whether ``t``'s elements fill its storage span exactly once, in some dimension order
    (PyTorch's non-overlapping-and-dense rule; its helper is private and was renamed in 2.11)."""
    if t.numel() == 0:
        return True
    expected = 1
    for size, stride in sorted(
        ((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda d: d[1]
    ):
        if stride != expected:
            return False
        expected *= size
    return True


# The namespaces of collective ops (c10d's, and the functional collectives').
_COLLECTIVES = ("c10d", "_c10d_functional")

DATA_DEPENDENT_OPS = {
    aten.copy_,
    aten._local_scalar_dense,
    aten.equal,
    aten.is_nonzero,
    aten.allclose,
    aten.nonzero,
    aten.index,
    aten.masked_select,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten._unique,
}


def data_dependent(func, args, kwargs):
    """Meta tensors have no values: answer value-dependent ops with a plausible stand-in (sizes
    of selections are the worst case, so memory is never underestimated). CPU tensors (Python
    ints a model turned into tensors, say) have their values and are computed."""
    p = func.overloadpacket
    if p not in DATA_DEPENDENT_OPS:
        return NotImplemented
    if (
        p is aten.copy_
        and args[0].device.type == "cpu"
        and isinstance(args[1], torch.Tensor)
        and args[1].device.type == "meta"
    ):
        # Values copied back off the GPU, which a meta tensor never had: the host keeps its own.
        # (DDP's reducer broadcasts its bucket order from rank 0, the traced rank, and reads it
        # back: rank 0's own values are the right ones.)
        return args[0]
    if not (args and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta"):
        return NotImplemented
    if p is aten._local_scalar_dense:
        t = args[0]
        return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
    if p in (aten.equal, aten.is_nonzero, aten.allclose):
        return True
    if p is aten.nonzero:
        t = args[0]
        return torch.empty((t.numel(), t.dim()), dtype=torch.long, device=t.device)
    if p is aten.index and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
    ):
        # Boolean-mask indexing (x[mask]): every element selected. Each k-dim mask becomes k
        # index tensors of its size, as nonzero would give.
        indices = []
        for i in args[1]:
            if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
                indices += [torch.empty((i.numel(),), dtype=torch.long, device=i.device)] * i.dim()
            else:
                indices.append(i)
        return func(args[0], indices)
    if p is aten.masked_select:
        t = args[0]
        return torch.empty((t.numel(),), dtype=t.dtype, device=t.device)
    if p in (aten._unique2, aten.unique_dim, aten.unique_consecutive, aten._unique):
        # One distinct value: code branches on "all rows agree" (Bart's one <eos> per row),
        # and these outputs are too small to matter for memory.
        t = args[0]
        outs = [
            torch.empty((1,), dtype=t.dtype, device=t.device),
            torch.empty(t.shape, dtype=torch.long, device=t.device),
            torch.empty((1,), dtype=torch.long, device=t.device),
        ]
        return tuple(outs[: 3 if p is not aten._unique else 2])
    return NotImplemented
