"""Command line: ``python -m gpumem_trace MODEL --batch N --out FILE [options]``.

Exit codes: 0 trace written; 2 bad model reference or option; 3 the model failed (import error
inside it, exception in forward/backward); 4 timed out.
"""

import argparse
import signal
import sys
import traceback


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpumem_trace", description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--out", required=True)
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--input", help="input shape CxHxW for image models")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--sdpa", default="flash", choices=["flash", "mem_efficient", "math"])
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--data-parallel", type=int, default=1, help="GPUs of a torch.nn.DataParallel job; the trace is GPU 0's")
    p.add_argument("--validate", default="none", choices=["none", "no-grad", "grad"],
                   help="after training, two eval-mode batches under torch.no_grad() or with autograd on")
    p.add_argument("--timeout", type=float, default=0, help="seconds; 0 = none")
    a = p.parse_args(argv)

    def fail(code, msg):
        print(f"gpumem_trace: {msg}", file=sys.stderr)
        return code

    if a.batch < 1 or a.iterations < 2 or a.grad_accum < 1 or a.data_parallel < 1:
        return fail(2, "--batch, --grad-accum and --data-parallel must be at least 1 and --iterations at least 2")
    shape = None
    if a.input:
        try:
            shape = tuple(int(x) for x in a.input.lower().split("x"))
            assert shape and all(x > 0 for x in shape)
        except (ValueError, AssertionError):
            return fail(2, f"--input `{a.input}` is not CxHxW")
    try:
        import torch  # noqa: F401
    except ImportError as e:
        return fail(3, f"cannot import torch: {e} (install it in this interpreter)")
    from .loop import TraceOptions, trace_training
    from .models import ReferenceError_

    def on_alarm(*_):
        raise TimeoutError

    if a.timeout > 0:
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, a.timeout)
    opts = TraceOptions(model=a.model, batch=a.batch, optimizer=a.optimizer, precision=a.precision, iterations=a.iterations,
                        input_shape=shape, seq_len=a.seq_len, sdpa=a.sdpa, checkpointing=a.checkpointing,
                        channels_last=a.channels_last, grad_accum=a.grad_accum, data_parallel=a.data_parallel,
                        validate=a.validate)
    try:
        trace_training(opts, a.out)
    except ReferenceError_ as e:
        return fail(2, str(e))
    except TimeoutError:
        return fail(4, f"tracing {a.model} timed out after {a.timeout:g} s")
    except Exception as e:  # the model's own failure
        tb = traceback.extract_tb(e.__traceback__)
        where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
        return fail(3, f"{a.model} failed while tracing: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{where}")
    finally:
        if a.timeout > 0:
            signal.setitimer(signal.ITIMER_REAL, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
