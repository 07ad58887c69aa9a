"""gpumem: how much GPU memory a training job will take, as nvidia-smi will show it, before it
touches a GPU — from Python, in-process.

    import gpumem, torchvision
    est = gpumem.estimate(torchvision.models.resnet50(), batch=64, gpu="h100-80gb-sxm")
    est.peak, est.upper_bound, est.fits, est.breakdown

``model`` is a live ``torch.nn.Module`` (on any device: a meta copy of it is traced, in a fork
of this process, and the model itself is never touched), a model reference as the ``gpumem``
command takes it (``torchvision:resnet50``, ``timm:...``, ``hf:CLASS(...)``, ``py:FILE:FN``), a
Hugging Face Hub id or a ``config.json`` path. The answer is the one ``gpumem estimate --json``
gives for the same job, to the byte: the same Rust core sizes it, in this process (the
interpreter's lock released meanwhile). docs/python.md has the whole API.
"""

import builtins
import html
import json
import os
import sys

from . import _host, _native

__version__ = _native.__version__
__all__ = [
    "Estimate",
    "estimate",
    "max_batch",
    "Plan",
    "plan",
    "track",
    "Tracked",
    "gpus",
    "Error",
    "InputError",
    "ModelError",
    "TimeoutError",
    "PythonError",
    "DoesNotFit",
]


class Error(Exception):
    """Every failure gpumem raises."""


class InputError(Error, ValueError):
    """The job as stated is wrong: its model, an option, the GPU."""


class ModelError(Error):
    """The model failed while it was traced (the message says where)."""


class TimeoutError(Error, builtins.TimeoutError):  # noqa: A001 - gpumem.TimeoutError by design
    """The trace outlived its deadline (GPUMEM_TRACE_TIMEOUT seconds, 900 by default)."""


class DoesNotFit(Error):
    """A job stopped before it starts (``stop_if_over``): its upper bound exceeds the GPU."""


class PythonError(Error):
    """This interpreter cannot trace: torch missing or too old."""


_ERRORS = {
    "input": InputError,
    "model": ModelError,
    "timeout": TimeoutError,
    "python": PythonError,
    "other": Error,
}

# References are traced by this interpreter (in a process of its own, as the command does);
# live models in forks of this process (``_host.run``).
os.environ.setdefault("GPUMEM_PYTHON", sys.executable)
_native.set_host_tracer(_host.run)


def _call(fn, *args):
    try:
        return json.loads(fn(*args))
    except _native.NativeError as e:
        kind, message = e.args
        raise _ERRORS[kind](message) from None


DEFAULT_GPU = "a100-40gb"  # the command's default


class Estimate:
    """One job's estimate: ``peak`` (bytes, as nvidia-smi will show it), ``upper_bound``
    (bytes: the true peak should not exceed it), ``fits``, ``breakdown`` (bytes by category at
    the peak), ``peak_at`` (where in the step), ``to_dict()`` (``gpumem estimate --json``)."""

    def __init__(self, report):
        self._report = report

    @property
    def peak(self):
        return self._report["peak_bytes"]

    @property
    def upper_bound(self):
        return self._report["upper_bound_bytes"]

    @property
    def fits(self):
        return self._report["fits"]

    @property
    def upper_bound_fits(self):
        return self._report["upper_bound_fits"]

    @property
    def gpu(self):
        return self._report["gpu"]

    @property
    def capacity_mib(self):
        return self._report["capacity_mib"]

    @property
    def breakdown(self):
        return dict(self._report["breakdown_bytes"])

    @property
    def peak_at(self):
        return self._report.get("peak_at")

    def to_dict(self):
        return json.loads(json.dumps(self._report))

    def __repr__(self):
        mib = 1 << 20
        return (
            f"Estimate(peak={self.peak / mib:.1f} MiB, upper_bound={self.upper_bound / mib:.1f} MiB, "
            f"gpu={self.gpu!r} ({self.capacity_mib:.0f} MiB), fits={self.fits})"
        )

    def _repr_html_(self):
        """The breakdown at the peak as a bar chart, for notebooks."""
        mib = 1 << 20
        parts = [(k, v) for k, v in self._report["breakdown_bytes"].items() if v > 0]
        largest = max((v for _, v in parts), default=1)
        rows = "".join(
            f"<tr><td>{html.escape(k)}</td><td style='text-align:right'>{v / mib:,.1f} MiB</td>"
            f"<td><div style='background:#4c78a8;height:0.8em;width:{200 * v / largest:.0f}px'>"
            "</div></td></tr>"
            for k, v in parts
        )
        verdict = "fits" if self.fits else "does NOT fit"
        return (
            f"<div><b>{html.escape(self._report['model'])}</b>, batch {self._report['batch_size']}"
            f" on {html.escape(self.gpu)}: peak <b>{self.peak / mib:,.1f} MiB</b>, upper bound "
            f"{self.upper_bound / mib:,.1f} MiB of {self.capacity_mib:,.0f} MiB — {verdict}"
            f"<table>{rows}</table></div>"
        )


def _job(
    model, input, seq_len, optimizer, precision, strategy, world_size, lora, checkpointing, options
):
    """The model's reference and the job document's options of a call."""
    doc = {"optimizer": optimizer, "precision": precision, "checkpointing": checkpointing}
    example = None
    if input is not None:
        if isinstance(input, (tuple, list)) and input and all(isinstance(n, int) for n in input):
            doc["input"] = "x".join(str(n) for n in input)
        else:
            example = input
    if seq_len is not None:
        doc["seq_len"] = seq_len
    if lora is not None:
        doc["lora"] = lora
    if strategy is not None:
        doc["strategy"] = _strategy(strategy, world_size)
    elif world_size not in (None, 1):
        raise InputError(f"world_size={world_size} without a strategy (ddp, fsdp, zero1..zero3)")
    doc.update(options or {})
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if isinstance(model, str):
        if example is not None:
            raise InputError("input= as an example batch applies to a live model, not a reference")
        reference = model
    else:
        import torch

        if not isinstance(model, torch.nn.Module):
            raise InputError(
                f"model must be a torch.nn.Module, a reference or a Hub id, not {type(model).__name__}"
            )
        try:
            reference = _host.register(model, example)
        except ValueError as e:
            raise InputError(str(e)) from None
    return reference, json.dumps(doc)


def _strategy(strategy, world_size):
    """``ddp``, ``fsdp``, ``zero1``..``zero3`` over ``world_size`` ranks, or the job document's
    own strategy table (a dict)."""
    if isinstance(strategy, dict):
        return strategy
    if world_size is None:
        raise InputError(f"strategy={strategy!r} needs world_size")
    name = str(strategy)
    if name.startswith("zero") and name[4:].isdigit():
        return {"kind": "zero", "stage": int(name[4:]), "world_size": world_size}
    return {"kind": name, "world_size": world_size}


def _train_config(config, kind):
    """A trainer's config as the native module reads it: a path's text, or a mapping as JSON."""
    if config is None:
        return None
    if isinstance(config, dict):
        file, text = "train_config", json.dumps(config, default=str)
    else:
        file = os.fspath(config)
        try:
            with open(file) as f:
                text = f.read()
        except OSError as e:
            raise InputError(f"train_config {file}: {e.strerror}") from None
    return json.dumps({"file": file, "text": text, "kind": kind})


def _profile(profile):
    if profile is None:
        return None
    try:
        with open(profile) as f:
            return f.read()
    except OSError as e:
        raise InputError(f"profile {profile}: {e.strerror}") from None


def estimate(
    model,
    *,
    batch,
    seq_len=None,
    input=None,
    optimizer="adamw",
    precision="fp32",
    gpu=DEFAULT_GPU,
    profile=None,
    strategy=None,
    world_size=None,
    lora=None,
    checkpointing=False,
    options=None,
    train_config=None,
    train_config_kind=None,
):
    """The job's peak on ``gpu`` (a built-in profile, see ``gpus()``; ``profile``: a profile
    TOML, such as ``gpumem calibrate`` writes, instead). ``batch`` is one rank's batch.
    ``input``: an image model's ``(C, H, W)``, or for a live model of your own an example batch
    (a tensor or tuple of tensors, batch first), which it is trained on with the mean of its first
    output as the loss. ``strategy``: ``ddp``, ``fsdp``, ``zero1``..``zero3`` with
    ``world_size``, or the job document's strategy table. ``lora``: the job document's LoRA
    table (``{"rank": 16, "alpha": 32, "targets": ["q_proj", "v_proj"]}``). ``options``: any
    other job-document options (``grad_accum``, ``outputs``, ``whole_run``, …; docs/json.md).
    ``train_config``: a trainer's config (a path, or a mapping such as
    ``TrainingArguments.to_dict()``; its kind detected, or ``train_config_kind``:
    ``hf-trainer``, ``trl-sft``, ``axolotl``, …), whose stated values win over the call's, as
    ``gpumem estimate --train-config`` reads it (docs/intake.md)."""
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise InputError(f"batch must be a positive whole number, not {batch!r}")
    reference, doc = _job(
        model,
        input,
        seq_len,
        optimizer,
        precision,
        strategy,
        world_size,
        lora,
        checkpointing,
        options,
    )
    config = _train_config(train_config, train_config_kind)
    return Estimate(_call(_native.estimate, reference, batch, doc, gpu, _profile(profile), config))


def max_batch(
    model,
    *,
    seq_len=None,
    input=None,
    optimizer="adamw",
    precision="fp32",
    gpu=DEFAULT_GPU,
    profile=None,
    strategy=None,
    world_size=None,
    lora=None,
    checkpointing=False,
    options=None,
    train_config=None,
    train_config_kind=None,
):
    """The largest per-rank batch whose upper bound fits on ``gpu`` (0: not even one); the
    job's other options as ``estimate`` takes them."""
    reference, doc = _job(
        model,
        input,
        seq_len,
        optimizer,
        precision,
        strategy,
        world_size,
        lora,
        checkpointing,
        options,
    )
    config = _train_config(train_config, train_config_kind)
    return _call(_native.max_batch, reference, doc, gpu, _profile(profile), config)["max_batch"]


class Plan:
    """A job's fastest setups that fit (``gpumem plan --json``): ``setups`` fastest first,
    ``best`` (the first, or ``None`` where nothing fits), ``too_big`` (per setup kind, the
    smallest micro-batch that does not fit), ``skipped`` (setups that could not be planned, with
    why), ``to_dict()``."""

    def __init__(self, report):
        self._report = report

    @property
    def setups(self):
        return list(self._report["setups"])

    @property
    def best(self):
        return self._report["setups"][0] if self._report["setups"] else None

    @property
    def too_big(self):
        return list(self._report["too_big"])

    @property
    def skipped(self):
        return list(self._report["skipped"])

    def to_dict(self):
        return json.loads(json.dumps(self._report))

    def __repr__(self):
        b = self.best
        if b is None:
            return f"Plan({self._report['model']!r} on {self._report['gpu']!r}: nothing fits)"
        setup = (
            f"{b['strategy'] or 'one GPU'}, {b['precision']}, checkpointing {b['checkpointing']}"
        )
        return (
            f"Plan(best={setup}, micro_batch={b['micro_batch']}, grad_accum={b['grad_accum']}, "
            f"upper_bound={b['upper_bound_mib']:.1f} MiB on {self._report['gpu']!r}; "
            f"{len(self._report['setups'])} setups fit)"
        )


def plan(
    model,
    *,
    gpu=DEFAULT_GPU,
    gpus=None,
    strategies=None,
    precisions=None,
    checkpointing="both",
    global_batch=None,
    bus_gbs=None,
    seq_len=None,
    input=None,
    optimizer="adamw",
    profile=None,
    strategy=None,
    world_size=None,
    lora=None,
    options=None,
    tp=None,
    pp=None,
    cp=None,
    ep=None,
    gpus_per_node=None,
):
    """The fastest setups of the job that fit ``gpu``, as ``gpumem plan`` searches them:
    precision (``precisions``; by default fp32, amp-bf16 where the GPU has it, amp-fp16) ×
    activation checkpointing (``checkpointing``: ``both``, ``all``, ``on`` or one mode) ×
    micro-batch (powers of two, or the divisors of ``global_batch`` with gradient accumulation
    making up the rest) and, over ``gpus`` GPUs, the multi-GPU ``strategies`` (ddp, fsdp,
    zero1..zero3; all by default) and FSDP's meshes of tensor, pipeline, context and expert
    parallelism (``tp``, ``pp``, ``cp``, ``ep``: lists of degrees; by default searched as far
    as a rank needs, tensor parallelism within ``gpus_per_node``), timed by the physical model
    (``bus_gbs``: the collectives' bandwidth per rank). ``strategy`` and ``world_size`` instead
    plan one rank of that job. The model and the other options as ``estimate`` takes them."""
    reference, doc = _job(
        model, input, seq_len, optimizer, "fp32", strategy, world_size, lora, False, options
    )
    request = {
        "gpus": gpus,
        "strategies": list(strategies or []),
        "precisions": list(precisions or []),
        "checkpointing": checkpointing,
        "global_batch": global_batch,
        "bus_gbs": bus_gbs,
        "tp": list(tp or []),
        "pp": list(pp or []),
        "cp": list(cp or []),
        "ep": list(ep or []),
        "gpus_per_node": gpus_per_node,
    }
    report = _call(_native.plan, reference, doc, gpu, json.dumps(request), _profile(profile))
    return Plan(report)


class Tracked:
    """What ``with gpumem.track(model, optimizer) as t:`` recorded of the code inside:
    ``t.estimate(gpu=..., profile=...)`` sizes it (as ``gpumem estimate`` sizes a trace file),
    ``t.save(path)`` writes its trace for the command (``gpumem estimate PATH``)."""

    def __init__(self, model, optimizers, gpu, batch):
        self._args = (model, optimizers, gpu, batch)
        self._tracker = None
        self._trace = None

    def __enter__(self):
        from gpumem_trace import track as _track

        model, optimizers, gpu, batch = self._args
        known = {g["name"]: g for g in gpus()}
        if gpu not in known:
            raise InputError(f"unknown GPU `{gpu}`; known: {', '.join(known)}")
        g = known[gpu]
        try:
            deadline = float(os.environ.get("GPUMEM_TRACE_TIMEOUT", "900"))
        except ValueError:
            raise InputError("GPUMEM_TRACE_TIMEOUT must be a number of seconds") from None
        where = _track.Gpu(g["display"], g["compute_capability"], g["capacity_mib"])
        try:
            self._tracker = _track.Tracker(model, optimizers, where, deadline, batch)
        except TypeError as e:
            raise InputError(str(e)) from None
        self._tracker.__enter__()
        return self

    def __exit__(self, kind, error, tb):
        from gpumem_trace import track as _track

        self._tracker.__exit__(kind, error, tb)
        if isinstance(error, _track.Timeout):
            raise TimeoutError(str(error)) from None
        if isinstance(error, _track.ValueDecides):  # the message names the line
            raise ModelError(str(error)) from None
        if error is None:
            self._trace = _track.trace_text(self._tracker)
        return False

    def _recorded(self):
        if self._trace is None:
            raise InputError(
                "nothing recorded: estimate once the `with gpumem.track(...)` block has ended"
            )
        return self._trace

    def estimate(self, gpu=None, profile=None):
        """The recorded code's peak on ``gpu`` (default: the GPU tracked for) or a profile TOML."""
        gpu = gpu or self._args[2]
        return Estimate(_call(_native.estimate_trace, self._recorded(), gpu, _profile(profile)))

    def save(self, path):
        """Writes the recorded trace to ``path`` (docs/trace-format.md)."""
        with open(path, "w") as f:
            f.write(self._recorded())


def track(model, optimizer=None, *, gpu=DEFAULT_GPU, batch=None):
    """Records your own training step: ``with gpumem.track(model, optimizer) as t:`` around
    your code (your loop, loss, ``GradScaler``, checkpointing), then ``t.estimate()``. Inside,
    CUDA is gpumem's stand-in for ``gpu``: the model's parameters and buffers are on it (meta
    tensors, recorded as the parameters), ``.cuda()`` / ``.to("cuda")`` of your batch puts it
    there, and ``optimizer`` (one, or a list: an iteration ends once each has stepped) steps
    there from an empty state. Nothing real moves to a GPU, and your model and optimizers are
    as they were once the block ends. Values computed inside are placeholders (``.item()``
    prints as ``?``); where your code branches on one, ``ModelError`` names the line.
    ``batch`` names the batch size in the estimate (default: the first batch's length)."""
    if optimizer is None:
        optimizers = []
    elif isinstance(optimizer, (list, tuple)):
        optimizers = list(optimizer)
    else:
        optimizers = [optimizer]
    return Tracked(model, optimizers, gpu, batch)


def gpus():
    """The built-in GPU profiles, as ``gpumem gpus --json`` lists them."""
    return _call(_native.gpus)
