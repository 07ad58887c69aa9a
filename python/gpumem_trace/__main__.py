"""Command line: ``python -m gpumem_trace MODEL --batch N [N ...] --out FILE [FILE ...] [options]``.

Several batch sizes are traced by one process (the model built anew for each, the imports paid
once), each into its own file: what gpumem needs to fit a batch-symbolic trace. Once torch and
the model's library are imported, each batch size is traced in a forked copy of the process, all
side by side (on Linux with more than one core; else one after another in the process itself).

Exit codes: 0 trace written; 2 bad model reference or option; 3 the model failed (import error
inside it, exception in forward/backward); 4 timed out.
"""

import argparse
import gc
import json
import os
import re
import signal
import sys
import traceback

# The oldest torch release the tracer is tested on (scripts/test.sh runs the pinned and newest).
OLDEST_TORCH = (2, 4)
# Seconds between alarms once --timeout has passed, until one is caught (see main's on_alarm).
ALARM_REPEAT_S = 2.0


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpumem_trace", description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--batch", type=int, nargs="+", default=[32])
    p.add_argument("--out", nargs="+", required=True)
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--input", help="input shape CxHxW for image models")
    p.add_argument("--seq-len", type=int)
    p.add_argument(
        "--gpu-capability",
        default="8.0",
        help="compute capability of the GPU the job will run on (decides the attention kernel)",
    )
    p.add_argument(
        "--sdpa",
        choices=["flash", "efficient", "cudnn", "math"],
        help="force this attention kernel where it applies",
    )
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument(
        "--selective",
        action="store_true",
        help="with --checkpointing: selective (op-level): matmul and attention outputs saved, the rest recomputed",
    )
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument(
        "--data-parallel",
        type=int,
        default=1,
        help="GPUs of a torch.nn.DataParallel job; the trace is GPU 0's",
    )
    p.add_argument(
        "--validate",
        default="none",
        choices=["none", "no-grad", "grad"],
        help="after training, two eval-mode batches under torch.no_grad() or with autograd on",
    )
    p.add_argument(
        "--outputs",
        choices=["kept", "dropped"],
        help="whether the loop holds the model's output through backward (default: kept, dropped for hf: models as their Trainer runs them)",
    )
    p.add_argument(
        "--attention-mask",
        default="none",
        choices=["none", "padded"],
        help="hf: models: pass the attention mask of a padded batch (materialised by the model) instead of none",
    )
    p.add_argument(
        "--strategy",
        choices=["ddp", "fsdp", "zero1", "zero2", "zero3"],
        help="trace rank 0 of a multi-GPU job wrapped this way (a fake process group; ZeRO modelled)",
    )
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's gradient bucket size")
    p.add_argument("--gradient-as-bucket-view", action="store_true")
    p.add_argument(
        "--no-reshard-after-forward",
        action="store_true",
        help="FSDP2: keep each layer's gathered parameters from forward to backward",
    )
    p.add_argument(
        "--fsdp-param-dtype",
        choices=["bf16", "fp16"],
        help="FSDP2: MixedPrecisionPolicy's param_dtype (gradients reduced in fp32)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="FSDP2: HSDP over this many replica groups (world size / replicas ranks each)",
    )
    p.add_argument(
        "--cpu-offload",
        action="store_true",
        help="FSDP2: CPUOffloadPolicy (shards, gradients and the optimizer step on the host)",
    )
    p.add_argument(
        "--zero",
        default="{}",
        help="ZeRO: a JSON object of gpumem_trace.zero.ZeroConfig's fields (DeepSpeed's defaults otherwise)",
    )
    p.add_argument("--lora-rank", type=int, help="LoRA fine-tuning, as PEFT sets it up: the rank r")
    p.add_argument("--lora-alpha", type=float, default=8.0)
    p.add_argument("--lora-targets", help="module names, comma-separated, or all-linear")
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument(
        "--lora-quant",
        choices=["nf4", "fp4"],
        help="QLoRA: the model loaded in 4 bits (bitsandbytes' Linear4bit) before LoRA",
    )
    p.add_argument(
        "--lora-single-quant",
        action="store_true",
        help="QLoRA without double quantization of the block statistics",
    )
    p.add_argument(
        "--depths",
        type=int,
        nargs="+",
        help="trace the model cut to each of these depths of its repeated blocks, into OUT.depthK, where it has enough of them to save time (gpumem rebuilds the whole depth from those traces); else whole, into OUT",
    )
    p.add_argument(
        "--slopes",
        action="store_true",
        help="with --depths and several batch sizes: trace the first as --depths says, every other only cut to the first depth, and a job whose buffers span blocks (DDP, ZeRO) whole at the first and cut to the first depth at each: gpumem carries what the batch does to each event of the cut traces over to the whole trace",
    )
    p.add_argument(
        "--every-iteration",
        action="store_true",
        help="run every iteration; by default, once an iteration ends the loop in its steady state (what it freed the one before made, and what outlives it matches that), the rest copy it",
    )
    p.add_argument("--timeout", type=float, default=0, help="seconds; 0 = none")
    a = p.parse_args(argv)

    def fail(code, msg):
        print(f"gpumem_trace: {msg}", file=sys.stderr)
        return code

    if min(a.batch) < 1 or a.iterations < 2 or a.grad_accum < 1 or a.data_parallel < 1:
        return fail(
            2,
            "--batch, --grad-accum and --data-parallel must be at least 1 and --iterations at least 2",
        )
    if a.depths and (min(a.depths) < 2 or len(set(a.depths)) != len(a.depths)):
        return fail(2, f"--depths {' '.join(map(str, a.depths))}: distinct depths of at least 2")
    if len(a.batch) != len(a.out):
        return fail(2, f"{len(a.batch)} batch sizes but {len(a.out)} output files")
    if not re.fullmatch(r"\d+\.\d+", a.gpu_capability):
        return fail(2, f"--gpu-capability `{a.gpu_capability}` is not MAJOR.MINOR (e.g. 9.0)")
    shape = None
    if a.input:
        try:
            shape = tuple(int(x) for x in a.input.lower().split("x"))
            assert shape and all(x > 0 for x in shape)
        except (ValueError, AssertionError):
            return fail(2, f"--input `{a.input}` is not CxHxW")
    preload(a.model)
    try:
        import torch
    except ImportError as e:
        return fail(3, f"cannot import torch: {e} (install it in this interpreter)")
    version = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    if version < OLDEST_TORCH:
        return fail(
            3,
            f"torch {torch.__version__} is older than {'.'.join(map(str, OLDEST_TORCH))}, the oldest release the tracer supports",
        )
    from .loop import SPANS_BLOCKS, TraceOptions, trace_training
    from .lora import from_flags
    from .models import ReferenceError_

    class TimedOut(BaseException):
        """Not an Exception: the model's and the tracer's own fallbacks (``except Exception``)
        must not swallow the alarm and run the model again."""

    expired = []

    def on_alarm(*_):
        expired.append(True)
        raise TimedOut

    if a.strategy and (a.world_size < 2 or a.bucket_cap_mb <= 0):
        return fail(2, "--strategy needs --world-size of at least 2 and a positive --bucket-cap-mb")
    if (
        a.replicas < 1
        or a.world_size % a.replicas
        or (a.replicas > 1 and a.world_size // a.replicas < 2)
    ):
        return fail(
            2,
            f"--replicas {a.replicas} must divide --world-size {a.world_size} into groups of at least 2 ranks",
        )
    zero = None
    if a.strategy and a.strategy.startswith("zero"):
        from .zero import ZeroConfig

        try:
            zero = ZeroConfig(
                stage=int(a.strategy[-1]), world_size=a.world_size, **json.loads(a.zero)
            )
        except (ValueError, TypeError) as e:
            return fail(2, f"--zero: {e}")
    try:
        adapters = from_flags(a)
    except ValueError as e:
        return fail(2, str(e))
    opts = TraceOptions(
        model=a.model,
        batch=a.batch[0],
        optimizer=a.optimizer,
        precision=a.precision,
        iterations=a.iterations,
        input_shape=shape,
        seq_len=a.seq_len,
        gpu_capability=a.gpu_capability,
        sdpa=a.sdpa,
        checkpointing=a.checkpointing,
        selective=a.selective,
        channels_last=a.channels_last,
        grad_accum=a.grad_accum,
        data_parallel=a.data_parallel,
        validate=a.validate,
        outputs=a.outputs,
        attention_mask=a.attention_mask,
        lora=adapters,
        strategy=a.strategy,
        world_size=a.world_size,
        bucket_cap_mb=a.bucket_cap_mb,
        bucket_view=a.gradient_as_bucket_view,
        reshard_after_forward=not a.no_reshard_after_forward,
        zero=zero,
        fsdp_param_dtype=a.fsdp_param_dtype,
        replicas=a.replicas,
        cpu_offload=a.cpu_offload,
        every_iteration=a.every_iteration,
    )
    spans = a.strategy in SPANS_BLOCKS

    def traced(batch, out, first):
        """Traces one batch size; its exit code (a failure is printed)."""
        try:
            opts.batch, opts.cut_spanning = batch, a.slopes
            depths = (
                a.depths[:1] if a.slopes and a.depths and (spans or not first) else a.depths or []
            )
            if not depths:
                trace_training(opts, out)
            else:
                for depth in depths:
                    opts.depth = depth
                    if "depth" not in trace_training(opts, f"{out}.depth{depth}"):
                        os.replace(
                            f"{out}.depth{depth}", out
                        )  # not cut (see loop.cut_blocks): the whole model's
                        break
                else:
                    if a.slopes and spans and first:  # cut for the batch only: the whole too
                        opts.depth = None
                        trace_training(opts, out)
        except Exception as e:
            if expired:  # the alarm, wrapped (see on_alarm): not the model's failure
                raise TimedOut from e
            if isinstance(e, ReferenceError_):
                return fail(2, str(e))
            tb = traceback.extract_tb(e.__traceback__)  # the model's own failure
            where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
            return fail(
                3,
                f"{a.model} failed while tracing: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{where}",
            )
        return 0

    if a.timeout > 0:
        signal.signal(signal.SIGALRM, on_alarm)
        # Again every ALARM_REPEAT_S until caught: an alarm raised inside an import or a class's
        # creation reaches the code as a RuntimeError, which a fallback (the model's, or the
        # tracer's own `except Exception`) can swallow, and the trace would run on untimed.
        signal.setitimer(signal.ITIMER_REAL, a.timeout, ALARM_REPEAT_S)
    try:
        return side_by_side(
            [(b, out, i == 0) for i, (b, out) in enumerate(zip(a.batch, a.out))], traced
        )
    except TimedOut:
        return fail(4, f"tracing {a.model} timed out after {a.timeout:g} s")
    finally:
        if a.timeout > 0:
            signal.setitimer(signal.ITIMER_REAL, 0)


def preload(ref):
    """Imports what tracing the model ``ref`` needs (torch, the tracer, the model's library)
    before any fork, so that every fork starts with them; a failure is left to the trace's own
    import, which reports it. The cyclic collector pauses meanwhile: the imports make hundreds of
    thousands of objects that live as long as the process, and scanning them over and over was
    a tenth of the imports' time (it runs again before any trace, which frees as the job would)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        import torch  # noqa: F401

        from . import loop  # noqa: F401

        if ref.startswith("hf:"):
            import transformers

            name = re.match(r"hf:([A-Za-z0-9_]+)", ref)
            if name:
                getattr(transformers, name.group(1), None)  # the model's module, lazily imported
        elif ref.startswith("timm:"):
            import timm  # noqa: F401
        elif ref.startswith("torchvision:"):
            import torchvision  # noqa: F401
        elif ref.startswith("smp:"):
            import segmentation_models_pytorch  # noqa: F401
    except Exception:
        pass
    finally:
        if collecting:
            gc.enable()


def fork(work):
    """Forks a copy of this process that runs ``work()`` and exits with the code it returns (3
    where it raises); returns the fork's pid. The fork ends with this process (Linux's
    PR_SET_PDEATHSIG), so that a stopped gpumem leaves no trace running."""
    sys.stdout.flush()
    sys.stderr.flush()
    # What exists now (torch's and the model library's modules: hundreds of thousands of
    # objects) lives as long as either copy: the collector stops scanning it, which took close
    # to a tenth of a trace's time (nor writes to its pages, which the forks share).
    gc.freeze()
    parent, pid = os.getpid(), os.fork()
    if pid:
        return pid
    code = 3
    try:
        try:
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        if os.getppid() == parent:  # else it ended before the call
            code = work()
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def side_by_side(jobs, run):
    """``run(*job)`` for each job, each in a forked copy of this process, all at once (up to two
    per core): sharing the cores, three traces on two end in the time of one and a half, where
    two at a time would take two. In turn in this process where it has one core or one job, or
    is not on Linux. The first failure's exit code (each failure prints its own message), or 0.
    A timeout (raised in this process; forks have no timer) kills the forks still running.
    Forks are made before this process runs any backward: PyTorch refuses backward in a fork
    made after its autograd engine started worker threads (torch 2.15's FSDP2 starts them)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    if cores < 2 or len(jobs) < 2 or sys.platform != "linux":
        return next((code for code in (run(*job) for job in jobs) if code), 0)
    running, codes = {}, {}
    try:
        for i, job in enumerate(jobs):
            if len(running) == 2 * cores:
                pid, status = os.wait()
                codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
            running[fork(lambda job=job: run(*job))] = i
        while running:
            pid, status = os.wait()
            codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    finally:
        for pid in running:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    for i, code in sorted(codes.items()):
        if code < 0:
            print(
                f"gpumem_trace: tracing batch size {jobs[i][0]} ended by signal {-code}",
                file=sys.stderr,
            )
            return 3
        if code:
            return code
    return 0


if __name__ == "__main__":
    code = main()
    # Exits without the interpreter's teardown of what the imports made (a second of one core,
    # which gpumem would wait for): the traces are written and closed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
