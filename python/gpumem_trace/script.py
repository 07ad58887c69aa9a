"""``gpumem run -- python train.py ARGS``: the user's script, unmodified, run on the stand-in
CUDA (track.py's recording) until it has made ``--steps`` optimizer steps (backward passes where
it makes no optimizer: weights updated by hand), then its trace and the tracer's answer written
as a trace request's are.

    python -m gpumem_trace.script --steps 3 --gpu '{"display": ..., "capability": "8.0",
        "capacity_mib": 40960}' --out TRACE --result ANSWER [--timeout S] -- train.py ARGS…

Whatever the script moves to "cuda" is on the stand-in: a module moved there is a model (its
parameters and buffers recorded as the parameters), a tensor is the input batch. Values are
placeholders; where one would decide a branch or a size, the run stops with the script's line.
"""

import argparse
import json
import os
import runpy
import sys

import torch

from .request import OK, Failure, model_failure, write_answer
from .track import Gpu, Recording, Timeout, ValueDecides, standin


class Stop(BaseException):
    """The steps asked for are recorded: the script stops here."""


class ScriptRun(Recording):
    """Every module the script moves to the stand-in is the job's, and every optimizer; an
    iteration ends at each optimizer step (at each backward pass while the script has made no
    optimizer), and after ``steps`` of them the script is stopped."""

    def __init__(self, name, steps, gpu, deadline_s=None):
        super().__init__(gpu, deadline_s)
        self.name, self.steps = name, steps
        self.moved = []
        self.optimizers_made = 0
        self.done = 0

    def model_name(self):
        return f"run:{self.name}"

    def _modules(self):
        return self.moved

    def _owns(self, optimizer):
        return True

    def _end_iteration(self):
        self.rec.iteration_end()
        self.done += 1
        if self.done >= self.steps:
            raise Stop

    def _stepped(self, optimizer):
        self._end_iteration()

    def _backward_done(self):
        if not self.optimizers_made:
            self._end_iteration()

    def _setup(self, stack):
        real_to = torch.nn.Module.to  # the stand-in's

        def to(module, *args, **kwargs):
            saved, self.rec.phase = self.rec.phase, "setup"
            try:
                out = real_to(module, *args, **kwargs)
            finally:
                self.rec.phase = saved
            if any(p.device.type == "meta" for p in module.parameters()):
                if not any(m is module for m in self.moved):
                    self.moved.append(module)
                    self.paths.names.update(
                        {id(m): n or type(module).__name__ for n, m in module.named_modules()}
                    )
            return out

        real_init = torch.optim.Optimizer.__init__

        def init(optimizer, *args, **kwargs):
            self.optimizers_made += 1
            return real_init(optimizer, *args, **kwargs)

        stack.enter_context(standin.patched(torch.nn.Module, to=to))
        stack.enter_context(standin.patched(torch.optim.Optimizer, __init__=init))


def run_script(argv, run):
    """Runs ``argv`` (``script.py ARGS`` or ``-m module ARGS``) as ``python`` would, as
    ``__main__``."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m gpumem_trace.script")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--gpu", required=True, help="JSON: display, capability, capacity_mib")
    p.add_argument("--out", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("script", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    script = [w for w in a.script if w != "--"] if a.script[:1] == ["--"] else a.script
    if not script or (script[0] == "-m" and len(script) < 2):
        write_answer(a.result, Failure("reference", "no script to run").answer())
        return 2
    g = json.loads(a.gpu)
    run = ScriptRun(
        script[1] if script[0] == "-m" else os.path.basename(script[0]),
        a.steps,
        Gpu(g["display"], g["capability"], g["capacity_mib"]),
        a.timeout,
    )
    if script[0] != "-m" and not os.path.isfile(script[0]):
        write_answer(a.result, Failure("reference", f"no script {script[0]}").answer())
        return 2
    failure = None
    try:
        with run:
            try:
                run_script(script, run)
            except Stop:
                pass
    except ValueDecides as e:
        failure = Failure("model", str(e))  # the message names the line
    except Timeout:
        failure = Failure("timeout", f"{script[0]} ran past its deadline of {a.timeout:g} s")
    except SystemExit as e:
        if e.code not in (None, 0):
            failure = Failure("model", f"{script[0]} exited with status {e.code} before its step")
    except Exception as e:
        failure = model_failure(e, f"{script[0]} failed")
    if failure is None and run.done == 0:
        failure = Failure(
            "model", f"{script[0]} ended without a training step on the GPU (no backward pass)"
        )
    if failure is None:
        run.write(a.out)
    write_answer(a.result, OK if failure is None else failure.answer())  # gpumem says it
    return 0 if failure is None else failure.code()


if __name__ == "__main__":
    sys.exit(main())
