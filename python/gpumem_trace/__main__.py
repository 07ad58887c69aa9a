"""Command line: ``python -m gpumem_trace --request FILE`` (what gpumem runs: one JSON document,
see ``request.py``), or ``python -m gpumem_trace MODEL --batch N [N ...] --out FILE [FILE ...]
[options]`` (a person's flags, turned into the same request).

Several batch sizes are traced by one process (the model built anew for each, the imports paid
once), each into its own file: what gpumem needs to fit a batch-symbolic trace. Once torch and
the model's library are imported, each batch size is traced in a forked copy of the process, all
side by side (on Linux with more than one core; else one after another in the process itself).

The answer (``{"status", "kind", "message", "where"}``) goes to the request's ``result`` file,
and a failure's message once to stderr. Exit codes: 0 trace written; 2 bad model reference or
option; 3 the model failed (import error inside it, exception in forward/backward); 4 timed
out.
"""

import argparse
import contextlib
import gc
import json
import os
import re
import signal
import sys
import traceback

from . import ac, float8
from .request import OK, VERSION, Failure, from_flags, model_failure, trace_options, write_answer

# The oldest torch release the tracer is tested on (scripts/test.sh runs the pinned and newest).
OLDEST_TORCH = (2, 4)
# Seconds between alarms once the timeout has passed, until one is caught (see run's on_alarm).
ALARM_REPEAT_S = 2.0


def flags():
    """A person's flags: what gpumem's request states, spelled for a command line."""
    p = argparse.ArgumentParser(prog="gpumem_trace", description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--batch", type=int, nargs="+", default=[32])
    p.add_argument("--out", nargs="+", required=True)
    p.add_argument("--result", help="write the answer (JSON) here")
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--input", help="input shape CxHxW for image models")
    p.add_argument("--seq-len", type=int)
    p.add_argument(
        "--seq-lens",
        type=lambda t: [int(n) for n in t.split(",")],
        default=[],
        help="one sequence length per iteration, in order (LEN,LEN,...; the iterations are their count)",
    )
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
    ac.add_flags(p)
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument(
        "--optimizer-in-backward",
        action="store_true",
        help="each parameter's optimizer step runs in backward as its gradient is ready",
    )
    p.add_argument(
        "--keep-grads",
        action="store_true",
        help="zero_grad(set_to_none=False): the gradients zeroed in place, kept between steps",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="the loss compiled as the trainer compiles it (torch.compile: AOTAutograd, Inductor)",
    )
    p.add_argument(
        "--chunked-ce",
        type=int,
        metavar="N",
        help="torchtune's chunked cross-entropy over N slices (causal language models)",
    )
    p.add_argument(
        "--activation-offloading",
        action="store_true",
        help="torchtune's OffloadActivations around the model's forward",
    )
    p.add_argument(
        "--reference-model",
        action="store_true",
        help="TRL's frozen KL reference beside the model, scoring each batch before the step",
    )
    p.add_argument(
        "--liger",
        nargs="?",
        const="",
        metavar="KERNELS",
        help="Liger's kernels on a Hugging Face model (KERNEL=true|false,...; alone: Liger's defaults)",
    )
    p.add_argument(
        "--float8",
        choices=float8.RECIPES,
        help="float8 training of the linear layers (torchao's Float8Linear, as torchtitan converts them)",
    )
    p.add_argument(
        "--float8-all-gather",
        action="store_true",
        help="with --float8 tensorwise under FSDP: weights all-gathered in float8",
    )
    p.add_argument(
        "--data-parallel",
        type=int,
        default=1,
        help="GPUs of a torch.nn.DataParallel job; the trace is GPU 0's",
    )
    p.add_argument("--validate", default="none", choices=["none", "no-grad", "grad"])
    p.add_argument(
        "--whole-run",
        action="store_true",
        help="trace the whole run: the load, the steps, and the evaluation --eval-batches states",
    )
    p.add_argument(
        "--eval-batches",
        type=int,
        metavar="N",
        help="the run ends with Hugging Face Trainer's evaluation loop of N batches",
    )
    p.add_argument("--eval-batch-size", type=int, metavar="B")
    p.add_argument("--eval-accumulation-steps", type=int, metavar="K")
    p.add_argument(
        "--eval-logits", action="store_true", help="the evaluation keeps logits for metrics"
    )
    p.add_argument(
        "--eval-inputs", action="store_true", help="with --eval-logits, the inputs are kept too"
    )
    p.add_argument(
        "--eval-no-concat", action="store_true", help="what is kept stays a list of batches"
    )
    p.add_argument(
        "--generate-tokens",
        type=int,
        metavar="N",
        help="after the evaluation, the model generates N tokens after each prompt",
    )
    p.add_argument("--generate-batch-size", type=int, metavar="B")
    p.add_argument("--generate-prompt-len", type=int, metavar="L")
    p.add_argument("--generate-top-k", type=int, metavar="K", help="transformers' top-k filter")
    p.add_argument("--generate-top-p", type=float, metavar="P", help="its top-p filter (1: none)")
    p.add_argument("--generate-min-p", type=float, metavar="P", help="its min-p filter (0: none)")
    p.add_argument(
        "--save",
        choices=["sharded", "full", "full-offload"],
        help="the run ends with a checkpoint's save, as the job's engine saves it",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="the run resumes from a checkpoint: the optimizer state is read in at the load",
    )
    p.add_argument(
        "--broadcast-load",
        action="store_true",
        help="FSDP: the model loads on rank 0 and is broadcast one whole parameter at a time",
    )
    p.add_argument("--outputs", choices=["kept", "dropped"])
    p.add_argument("--attention-mask", default="none", choices=["none", "padded"])
    p.add_argument(
        "--attention",
        choices=["sdpa", "eager", "flash"],
        help="a Hugging Face model's attention implementation (default: the model's own)",
    )
    p.add_argument("--strategy", choices=["ddp", "fsdp", "zero1", "zero2", "zero3"])
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--bucket-cap-mb", type=int, default=25)
    p.add_argument("--gradient-as-bucket-view", action="store_true")
    p.add_argument("--no-reshard-after-forward", action="store_true")
    p.add_argument("--fsdp-param-dtype", choices=["bf16", "fp16"])
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks: alone, a job of that many; with --strategy fsdp, within --world-size",
    )
    p.add_argument(
        "--no-sequence-parallel",
        action="store_true",
        help="with --tp: the norms and the stream between layers whole on every rank",
    )
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (composes as --tp does)")
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel ranks of a torchtitan model (composes as --tp does)",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks of a torchtitan MoE model, borrowed from --strategy fsdp's",
    )
    p.add_argument(
        "--routing-imbalance",
        type=float,
        default=1.0,
        help="the router's stand-in: the traced rank's experts get this many times their even share (1: balanced)",
    )
    p.add_argument("--pp-rank", type=int, default=0, help="which stage's rank to trace")
    p.add_argument("--schedule", default="1f1b", help="the pipeline schedule")
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--virtual-stages", type=int, default=1)
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument(
        "--sync-each-batch",
        action="store_true",
        help="FSDP under --grad-accum: reduce each micro-batch's gradients (else no_sync until the last)",
    )
    p.add_argument("--zero", default="{}", help="ZeRO: a JSON object of zero_optimization settings")
    p.add_argument("--lora-rank", type=int)
    p.add_argument("--lora-alpha", type=float, default=8.0)
    p.add_argument("--lora-targets", help="module names, comma-separated, or all-linear")
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--lora-quant", choices=["nf4", "fp4"])
    p.add_argument("--lora-single-quant", action="store_true")
    p.add_argument(
        "--depths",
        type=int,
        nargs="+",
        help="trace the model cut to each of these depths of its repeated blocks, into OUT.depthK, where it has enough of them to save time; else whole, into OUT",
    )
    p.add_argument(
        "--slopes",
        action="store_true",
        help="with --depths and several batch sizes: the first as --depths says, every other only cut to the first depth (and a job whose buffers span blocks whole at the first)",
    )
    p.add_argument("--every-iteration", action="store_true")
    p.add_argument("--timeout", type=float, default=0, help="seconds; 0 = none")
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--request"] and len(argv) == 2:
        with open(argv[1]) as f:
            request = json.load(f)
    else:
        a = flags().parse_args(argv)
        try:
            request = from_flags(a)
        except ValueError as e:
            print(f"gpumem_trace: {e}", file=sys.stderr)
            return 2
    return answer(request)


def answer(request):
    """Runs the request; writes its answer to its ``result`` file and a failure's message once
    to stderr; returns the exit code."""
    failure = run(request)
    write_answer(request.get("result"), OK if failure is None else failure.answer())
    if failure is None:
        return 0
    where = f" (at {failure.where})" if failure.where else ""
    print(f"gpumem_trace: {failure.message}{where}", file=sys.stderr)
    return failure.code()


def run(request):
    """Traces the request's job at each of its batch sizes; the failure, or ``None``."""
    model, batches, outs = request["model"], request["batches"], request["outs"]
    depths, slopes = request.get("depths") or [], request.get("slopes", False)
    timeout = request.get("timeout_s") or 0
    if request.get("version") != VERSION:
        return Failure(
            "reference",
            f"this tracer reads requests of version {VERSION}, not {request.get('version')}: gpumem and its tracer differ",
        )
    if len(batches) != len(outs):
        return Failure("reference", f"{len(batches)} batch sizes but {len(outs)} output files")
    preload(model)
    try:
        import torch
    except ImportError as e:
        return Failure("python", f"cannot import torch: {e} (install it in this interpreter)")
    version = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    if version < OLDEST_TORCH:
        return Failure(
            "python",
            f"torch {torch.__version__} is older than {'.'.join(map(str, OLDEST_TORCH))}, the oldest release the tracer supports",
        )
    from .loop import SPANS_BLOCKS, trace_training
    from .models import ReferenceError_

    class TimedOut(BaseException):
        """Not an Exception: the model's and the tracer's own fallbacks (``except Exception``)
        must not swallow the alarm and run the model again."""

    expired = []

    def on_alarm(*_):
        expired.append(True)
        raise TimedOut

    try:
        opts = trace_options(request)
    except ValueError as e:
        return Failure("reference", str(e))
    except (KeyError, TypeError) as e:  # a request gpumem would not send (a person's flags)
        return Failure("reference", f"the request's options: {type(e).__name__}: {e}")
    spans = opts.strategy in SPANS_BLOCKS

    def traced(batch, out, first):
        """Traces one batch size; its failure, or ``None``."""
        try:
            opts.batch, opts.cut_spanning = batch, slopes
            cut = depths[:1] if slopes and depths and (spans or not first) else depths
            if not cut:
                trace_training(opts, out)
            else:
                for depth in cut:
                    opts.depth = depth
                    if "depth" not in trace_training(opts, f"{out}.depth{depth}"):
                        # not cut (see loop.cut_blocks): the whole model's
                        os.replace(f"{out}.depth{depth}", out)
                        break
                else:
                    if slopes and spans and first:  # cut for the batch only: the whole too
                        opts.depth = None
                        trace_training(opts, out)
        except Exception as e:
            if expired:  # the alarm, wrapped (see on_alarm): not the model's failure
                raise TimedOut from e
            if isinstance(e, ReferenceError_):
                return Failure("reference", str(e))
            return model_failure(e, f"{model} failed while tracing")
        return None

    if timeout > 0:
        # A courtesy: gpumem kills a trace that outlives its deadline. Again every
        # ALARM_REPEAT_S until caught: an alarm raised inside an import or a class's creation
        # reaches the code as a RuntimeError, which a fallback can swallow.
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout, ALARM_REPEAT_S)
    try:
        return side_by_side(
            [(b, out, i == 0) for i, (b, out) in enumerate(zip(batches, outs))], traced
        )
    except TimedOut:
        return Failure("timeout", f"tracing {model} timed out after {timeout:g} s")
    finally:
        if timeout > 0:
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
    is not on Linux. The first job's failure (a ``Failure``; each fork hands its own back in a
    file beside its output), or ``None``. A timeout (raised in this process; forks have no
    timer) kills the forks still running. Forks are made before this process runs any
    backward: PyTorch refuses backward in a fork made after its autograd engine started worker
    threads (torch 2.15's FSDP2 starts them)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    if cores < 2 or len(jobs) < 2 or sys.platform != "linux":
        return next((f for f in (run(*job) for job in jobs) if f is not None), None)
    running, codes = {}, {}
    handed = [f"{job[1]}.failure.{os.getpid()}" for job in jobs]

    def in_fork(i):
        failure = run(*jobs[i])
        if failure is None:
            return 0
        write_answer(handed[i], failure.answer())
        return failure.code()

    def failure(i, code):
        try:
            with open(handed[i]) as f:
                a = json.load(f)
            return Failure(a["kind"], a["message"], a["where"])
        except OSError:  # it died before it could say why
            how = f"ended by signal {-code}" if code < 0 else f"failed (exit {code})"
            return Failure("model", f"tracing batch size {jobs[i][0]} {how}")

    try:
        for i in range(len(jobs)):
            if len(running) == 2 * cores:
                pid, status = os.wait()
                codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
            running[fork(lambda i=i: in_fork(i))] = i
        while running:
            pid, status = os.wait()
            codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
        return next((failure(i, c) for i, c in sorted(codes.items()) if c), None)
    finally:
        for pid in running:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        for path in handed:
            with contextlib.suppress(OSError):
                os.remove(path)


if __name__ == "__main__":
    code = main()
    # Exits without the interpreter's teardown of what the imports made (a second of one core,
    # which gpumem would wait for): the traces are written and closed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
