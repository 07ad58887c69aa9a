"""The tracer's request and its answer.

gpumem sends one JSON document per tracer run (its Rust ``TracerRequest``; the JSON Schema of it,
generated from the Rust types, is ``request.schema.json`` beside this file, and the tests hold
this loader to it). ``trace_options`` loads the request's job straight into ``TraceOptions``:
the options were checked where they were made, so nothing here checks them again. The answer is
one JSON document, ``{"status", "kind", "message", "where"}``, written to the request's
``result`` path (see ``Failure``).
"""

import json
import math
import os
import re
import traceback
from dataclasses import dataclass

from . import ac, pipeline

# The request format this tracer reads (the Rust side's `TracerRequest::VERSION`).
VERSION = 1


@dataclass
class Failure:
    """Why a trace failed: ``kind`` is ``reference`` (the model reference or an option is
    wrong), ``model`` (the model itself failed), ``timeout`` or ``python`` (the interpreter or
    torch); ``where`` is ``file:line`` of the failure where it is known."""

    kind: str
    message: str
    where: str = None

    EXIT = {"reference": 2, "model": 3, "timeout": 4, "python": 3}

    def code(self):
        return self.EXIT[self.kind]

    def answer(self):
        return {"status": "failed", "kind": self.kind, "message": self.message, "where": self.where}


OK = {"status": "ok", "kind": None, "message": None, "where": None}


def model_failure(e, what):
    """``e``, raised by the user's code (a model, a script), as the failure of ``what``: where
    that code is — the innermost frame outside torch and this tracer (else the innermost)."""
    import torch

    tb = traceback.extract_tb(e.__traceback__)
    ours = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
    tb = [f for f in tb if not f.filename.startswith(ours)] or tb
    first_line = str(e).splitlines()[0] if str(e) else ""
    return Failure(
        "model",
        f"{what}: {type(e).__name__}: {first_line}",
        f"{tb[-1].filename}:{tb[-1].lineno}" if tb else None,
    )


def write_answer(path, answer):
    """Writes the answer to ``path`` (whole, or not at all: a reader never sees half of one)."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(answer, f)
    os.replace(tmp, path)


def liger_document(spec):
    """``--liger KERNEL=true|false,...`` as the job document states it (None: no Liger)."""
    if spec is None:
        return None
    kernels = {}
    for item in filter(None, (t.strip() for t in spec.split(","))):
        name, _, value = item.partition("=")
        if value not in ("true", "false"):
            raise ValueError(f"--liger: `{item}` is not KERNEL=true or KERNEL=false")
        kernels[name.strip()] = value == "true"
    return kernels


def trace_options(request):
    """The ``TraceOptions`` of a request's job (its first batch size; the caller sets the others)."""
    from .loop import TraceOptions
    from .lora import Lora

    o = request["options"]
    capability = request.get("gpu_capability", "8.0")
    if not re.fullmatch(r"\d+\.\d+", capability):
        raise ValueError(f"gpu_capability `{capability}` is not MAJOR.MINOR (e.g. 9.0)")
    checkpointing = o.get("checkpointing", False)
    lora = o.get("lora") and Lora.from_document(o["lora"])
    input_shape = o.get("input")
    seq_lens = tuple(request.get("seq_lens") or ()) or None
    return TraceOptions(
        model=request["model"],
        batch=request["batches"][0],
        optimizer=o.get("optimizer", "adam"),
        precision=o.get("precision", "fp32"),
        iterations=len(seq_lens) if seq_lens else request.get("iterations", 3),
        pipeline_rank=request.get("pipeline_rank", 0),
        routing_imbalance=request.get("routing_imbalance", 1.0),
        input_shape=tuple(int(x) for x in input_shape.split("x")) if input_shape else None,
        seq_len=o.get("seq_len"),
        seq_lens=seq_lens,
        gpu_capability=capability,
        sdpa=request.get("sdpa"),
        checkpointing=ac.mode_of(checkpointing),
        channels_last=o.get("channels_last", False),
        grad_accum=o.get("grad_accum", 1),
        data_parallel=o.get("data_parallel", 1),
        validate=o.get("validate", "none"),
        outputs=o.get("outputs"),
        attention_mask=o.get("attention_mask", "none"),
        attention=o.get("attention"),
        lora=lora,
        optimizer_in_backward=o.get("optimizer_in_backward", False),
        keep_grads=o.get("keep_grads", False),
        chunked_ce=o.get("chunked_ce"),
        compile=o.get("compile", False),
        liger=o.get("liger"),
        float8=o.get("float8"),
        activation_offloading=o.get("activation_offloading", False),
        reference_model=o.get("reference_model", False),
        whole_run=o.get("whole_run"),
        every_iteration=request.get("every_iteration", False),
        document=o,
        **strategy_options(o.get("strategy")),
    )


def whole_run_document(a):
    """The whole run the command line states (`--whole-run`, an `--eval-*` or `--generate-*` flag,
    `--save`, `--resume` or `--broadcast-load`), as the job vocabulary spells it; None for the
    training steps alone."""
    evaluation = None
    if a.eval_batches is not None:
        evaluation = {"batches": a.eval_batches, "logits": a.eval_logits}
        if a.eval_inputs:
            evaluation["inputs"] = True
        if a.eval_no_concat:
            evaluation["as_list"] = True
        if a.eval_batch_size is not None:
            evaluation["batch_size"] = a.eval_batch_size
        if a.eval_accumulation_steps is not None:
            evaluation["accumulation_steps"] = a.eval_accumulation_steps
    generation = None
    if a.generate_tokens is not None:
        generation = {"new_tokens": a.generate_tokens}
        if a.generate_batch_size is not None:
            generation["batch_size"] = a.generate_batch_size
        if a.generate_prompt_len is not None:
            generation["prompt_len"] = a.generate_prompt_len
        filters = {
            "top_k": a.generate_top_k or None,
            "top_p": (a.generate_top_p or 1.0) < 1.0,
            "min_p": (a.generate_min_p or 0.0) > 0.0,
        }
        if any(filters.values()):
            generation["filters"] = {k: v for k, v in filters.items() if v}
    load = a.resume or a.broadcast_load
    if not (a.whole_run or evaluation or generation or a.save or load):
        return None
    doc = {
        "evaluation": evaluation,
        "generation": generation,
        "save": a.save,
        "resume": a.resume or None,
        "broadcast_load": a.broadcast_load or None,
    }
    return {k: v for k, v in doc.items() if v is not None}


def strategy_options(strategy):
    """``TraceOptions``' fields of a strategy: its engine over its mesh's ranks."""
    if not strategy:
        return {}
    mesh = strategy["mesh"]
    # Expert parallelism borrows its ranks from the others' (torchtitan's and Megatron's way).
    world = math.prod(n for dim, n in mesh.items() if dim != "expert")
    kind = strategy["kind"]
    if kind == "ddp":
        return dict(
            strategy="ddp",
            world_size=world,
            bucket_cap_mb=strategy.get("bucket_cap_mb", 25),
            bucket_view=strategy.get("bucket_view", False),
        )
    if kind == "fsdp":
        return dict(
            strategy="fsdp",
            world_size=world,
            replicas=mesh.get("replicate", 1),
            tensor=mesh.get("tensor", 1),
            sequence_parallel=strategy.get("sequence_parallel", True),
            pipeline=mesh.get("pipeline", 1),
            expert=mesh.get("expert", 1),
            context=mesh.get("context", 1),
            schedule=strategy.get("schedule"),
            microbatches=strategy.get("microbatches", 1),
            virtual_stages=strategy.get("virtual_stages", 1),
            reshard_after_forward=strategy.get("reshard_after_forward", True),
            fsdp_param_dtype=strategy.get("param_dtype"),
            cpu_offload=strategy.get("cpu_offload", False),
            sync_each_batch=strategy.get("sync_each_batch", False),
        )
    from .zero import ZeroConfig

    stage = strategy["stage"]
    return dict(
        strategy=f"zero{stage}",
        world_size=world,
        zero=ZeroConfig(stage=stage, world_size=world, **strategy.get("zero", {})),
    )


def lora_document(a):
    """The LoRA a person's ``--lora-*`` flags state, as the job vocabulary spells it (``None``
    without --lora-rank; ``record``'s flags have no QLoRA ones), checked: ValueError says what
    is wrong."""
    if a.lora_rank is None:
        return None
    if a.lora_rank < 1 or not a.lora_targets or not 0 <= a.lora_dropout < 1 or a.lora_alpha <= 0:
        raise ValueError(
            "--lora-rank must be at least 1, --lora-alpha positive, --lora-targets given, --lora-dropout in [0, 1)"
        )
    doc = {
        "rank": a.lora_rank,
        "alpha": a.lora_alpha,
        "targets": a.lora_targets.split(","),
        "dropout": a.lora_dropout,
    }
    quant = getattr(a, "lora_quant", None)
    if quant:
        doc["quant"] = {"nf4": quant == "nf4", "double_quant": not a.lora_single_quant}
    return doc


def from_flags(a):
    """The request a person's flags state (``python -m gpumem_trace MODEL --batch …``), in the
    form gpumem sends: the options as the job vocabulary spells them. What a person types is
    checked here (ValueError says what is wrong); gpumem's own requests are checked where they
    are made, in its job vocabulary, and come in through ``--request``."""
    if min(a.batch) < 1 or a.iterations < 2 or a.grad_accum < 1 or a.data_parallel < 1:
        raise ValueError(
            "--batch, --grad-accum and --data-parallel must be at least 1 and --iterations at least 2"
        )
    if a.depths and (min(a.depths) < 2 or len(set(a.depths)) != len(a.depths)):
        raise ValueError(f"--depths {' '.join(map(str, a.depths))}: distinct depths of at least 2")
    if a.strategy and (a.world_size < 2 or a.bucket_cap_mb < 1):
        raise ValueError(
            "--strategy needs --world-size of at least 2 and a positive --bucket-cap-mb"
        )
    if (
        a.replicas < 1
        or a.world_size % a.replicas
        or (a.replicas > 1 and a.world_size // a.replicas < 2)
    ):
        raise ValueError(
            f"--replicas {a.replicas} must divide --world-size {a.world_size} into groups of at least 2 ranks"
        )
    if min(a.tp, a.pp, a.cp) < 1 or (
        max(a.tp, a.pp, a.cp) > 1 and a.strategy not in (None, "fsdp")
    ):
        raise ValueError(
            f"--tp {a.tp}, --pp {a.pp}, --cp {a.cp}: at least 1, and tensor, pipeline and context parallelism compose with fsdp"
        )
    if a.ep < 1 or (a.ep > 1 and a.strategy != "fsdp") or not a.routing_imbalance >= 1:
        raise ValueError(
            f"--ep {a.ep}, --routing-imbalance {a.routing_imbalance}: at least 1, and expert parallelism borrows --strategy fsdp's ranks"
        )
    if a.ep > 1 and (a.world_size // (a.replicas * a.pp)) % a.ep:
        raise ValueError(
            f"--ep {a.ep} does not divide the {a.world_size // (a.replicas * a.pp)} FSDP and tensor-parallel ranks it borrows"
        )
    if a.float8_all_gather and (a.float8 != "tensorwise" or a.strategy != "fsdp"):
        needs = "the tensorwise recipe" if a.float8 != "tensorwise" else "--strategy fsdp"
        raise ValueError(f"--float8-all-gather gathers FSDP's weights in float8: it needs {needs}")
    if a.sync_each_batch and a.strategy != "fsdp":
        raise ValueError(
            "--sync-each-batch is FSDP's (--strategy fsdp): how it reduces gradients under --grad-accum"
        )
    if a.pp > 1 and (a.schedule not in pipeline.SCHEDULES or not 0 <= a.pp_rank < a.pp):
        raise ValueError(
            f"--pp {a.pp}: --schedule one of {', '.join(pipeline.SCHEDULES)}, --pp-rank below {a.pp}"
        )
    if a.no_sequence_parallel and (a.tp < 2 or a.pp > 1 or a.cp > 1):
        raise ValueError(
            "--no-sequence-parallel applies to --tp without --pp or --cp (their stream is split over the sequence)"
        )
    model_parallel = a.tp * a.pp * a.cp
    if model_parallel > 1 and not a.strategy:
        a.strategy, a.world_size = "fsdp", model_parallel
    if a.world_size % (a.replicas * model_parallel):
        raise ValueError(
            f"--world-size {a.world_size} is not a multiple of --replicas {a.replicas} x --tp {a.tp} x --pp {a.pp} x --cp {a.cp}"
        )
    strategy = None
    if a.strategy in ("ddp", "fsdp"):
        if a.strategy == "ddp":
            strategy = {
                "kind": "ddp",
                "mesh": {"replicate": a.world_size},
                "bucket_cap_mb": a.bucket_cap_mb,
                "bucket_view": a.gradient_as_bucket_view,
            }
        else:
            mesh = {"shard": a.world_size // (a.replicas * model_parallel)}
            if a.replicas > 1:
                mesh["replicate"] = a.replicas
            if a.tp > 1:
                mesh["tensor"] = a.tp
            if a.cp > 1:
                mesh["context"] = a.cp
            if a.pp > 1:
                mesh["pipeline"] = a.pp
            if a.ep > 1:
                mesh["expert"] = a.ep
            strategy = {
                "kind": "fsdp",
                "mesh": mesh,
                "reshard_after_forward": not a.no_reshard_after_forward,
                "param_dtype": a.fsdp_param_dtype,
                "cpu_offload": a.cpu_offload,
            }
            if a.sync_each_batch:
                strategy["sync_each_batch"] = True
            if a.no_sequence_parallel:
                strategy["sequence_parallel"] = False
            if a.pp > 1:
                strategy.update(
                    schedule=a.schedule,
                    microbatches=a.microbatches,
                    virtual_stages=a.virtual_stages,
                )
    elif a.strategy:
        strategy = {
            "kind": "zero",
            "mesh": {"shard": a.world_size},
            "stage": int(a.strategy[-1]),
            "zero": json.loads(a.zero),
        }
    lora = lora_document(a)
    checkpointing = ac.mode_of(a.checkpointing, a.selective)
    # Off and full as the job vocabulary stores them (false, true); the other modes by name.
    checkpointing = {"off": False, "full": True}.get(checkpointing, checkpointing)
    return {
        "version": VERSION,
        "model": a.model,
        "batches": a.batch,
        "outs": a.out,
        "options": {
            "optimizer": a.optimizer,
            "precision": a.precision,
            "input": a.input,
            "seq_len": a.seq_len,
            # A schedule is gpumem's to draw; the tracer is given the drawn lengths (seq_lens),
            # and each image side as a job of its own.
            "seq_lens": None,
            "image_sides": None,
            "checkpointing": checkpointing,
            "channels_last": a.channels_last,
            "grad_accum": a.grad_accum,
            "data_parallel": a.data_parallel,
            "validate": a.validate,
            "outputs": a.outputs,
            "attention_mask": a.attention_mask,
            "attention": a.attention,
            "lora": lora,
            "strategy": strategy,
            "optimizer_in_backward": a.optimizer_in_backward,
            "keep_grads": a.keep_grads,
            "chunked_ce": a.chunked_ce,
            "compile": a.compile,
            "activation_offloading": a.activation_offloading,
            "reference_model": a.reference_model,
            "liger": liger_document(a.liger),
            "float8": {"recipe": a.float8, "fsdp_all_gather": a.float8_all_gather}
            if a.float8
            else None,
            "whole_run": whole_run_document(a),
        },
        "gpu_capability": a.gpu_capability,
        "sdpa": a.sdpa,
        "iterations": len(a.seq_lens) if a.seq_lens else a.iterations,
        "seq_lens": a.seq_lens,
        "pipeline_rank": a.pp_rank,
        "routing_imbalance": a.routing_imbalance,
        "depths": a.depths or [],
        "slopes": a.slopes,
        "every_iteration": a.every_iteration,
        "timeout_s": a.timeout,
        "result": a.result,
    }
