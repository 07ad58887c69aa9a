"""``python -m gpumem_trace.pool``: one tracer process that imports torch (and each model library)
once and forks a copy of itself for every trace, so that the many traces of a plan do not each
pay seconds of imports.

Requests come on stdin, one JSON object per line: ``{"id": N, "request": {...}, "log": PATH}``
(``request``: the tracer's request, see ``request.py``). A fork answers it (``__main__.answer``),
its stdout and stderr into ``log``; when it ends, this process answers ``{"id": N, "code": EXIT}``
on stdout (a negative code: the signal that ended it). ``{"kill": N}`` kills request N's fork and
everything it forked (its process group): gpumem's deadline. At the end of stdin (gpumem is done,
or was stopped), forks still running are killed.
Linux only (``fork``); gpumem runs each trace as its own process elsewhere.
"""

import json
import os
import select
import signal
import sys

from .__main__ import answer, fork, preload


def fork_trace(request):
    """Forks a copy of this process that runs the request and exits with its code."""

    def run():
        os.dup2(
            os.open(os.devnull, os.O_RDONLY), 0
        )  # the requests are this process's parent's to read
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.setpgid(0, 0)  # its own group: a kill reaches the forks it makes too
        return answer(request["request"])

    return fork(run)


def serve():
    running = {}  # pid -> request id
    pending = b""

    def report(pid, status):
        print(
            json.dumps({"id": running.pop(pid), "code": os.waitstatus_to_exitcode(status)}),
            flush=True,
        )

    try:
        while True:
            # Forks end while requests wait: look for both (a fork's end within 20 ms).
            ready, _, _ = select.select([0], [], [], 0.02 if running else None)
            if ready:
                chunk = os.read(0, 1 << 16)
                if not chunk:
                    return
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in filter(bytes.strip, lines):
                    request = json.loads(line)
                    if "kill" in request:
                        for pid, id_ in running.items():
                            if id_ == request["kill"]:
                                kill_group(pid)
                        continue
                    preload(request["request"]["model"])
                    running[fork_trace(request)] = request["id"]
            while running:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                report(pid, status)
    finally:
        for pid in list(running):
            kill_group(pid)
            os.waitpid(pid, 0)


def kill_group(pid):
    """Kills a fork and what it forked (its group, once it has made it; else the fork)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    serve()
    # Ends without the interpreter's teardown of what the imports made: a second of one core,
    # spent after gpumem has exited, on the cores the next command wants.
    sys.stdout.flush()
    os._exit(0)
