"""Tracer cost against plain FakeTensor memory counting of the same training step (the seed's
baseline: FakeTensorMode + a dispatch mode that sums live fake-tensor bytes).

    python python/tools/bench_tracer.py torchvision:resnet50 --batch 32 --repeat 3
"""

import argparse
import statistics
import sys
import tempfile
import time
import weakref
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from gpumem_trace.loop import TraceOptions, trace_training  # noqa: E402
from gpumem_trace.models import resolve  # noqa: E402


class FakeTensorMemoryCounter(TorchDispatchMode):
    """Live fake-tensor bytes, counted per storage (the seed's FakeTensorMemoryProfilerMode)."""

    def __init__(self):
        super().__init__()
        self.count = Counter()
        self.use = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage()._cdata
                if key not in self.count:
                    self.use += t.untyped_storage().nbytes()
                    self.peak = max(self.peak, self.use)
                self.count[key] += 1
                weakref.finalize(t, self.drop, key, t.untyped_storage().nbytes())
        return out

    def drop(self, key, n):
        self.count[key] -= 1
        if self.count[key] == 0:
            del self.count[key]
            self.use -= n


def fake_count(ref, batch):
    job = resolve(ref, batch_hint=batch)
    with FakeTensorMode(allow_non_fake_inputs=True) as fm, FakeTensorMemoryCounter() as c:
        model = job.model
        params = {n: fm.from_tensor(p) for n, p in model.named_parameters()}
        x = [torch.empty(s, dtype=d) for s, d in job.batch_specs(batch)]
        out = torch.func.functional_call(model, params, (x[0],))
        loss = job.loss(out, x)
        loss.backward()
    return c.peak


def main():
    a = argparse.ArgumentParser()
    a.add_argument("model", default="torchvision:resnet50", nargs="?")
    a.add_argument("--batch", type=int, default=32)
    a.add_argument("--repeat", type=int, default=3)
    args = a.parse_args()
    fake, ours = [], []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        fake_count(args.model, args.batch)
        fake.append(time.perf_counter() - t0)
        with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
            t0 = time.perf_counter()
            trace_training(TraceOptions(model=args.model, batch=args.batch, iterations=1), f.name)
            ours.append(time.perf_counter() - t0)
    mf, mo = statistics.median(fake), statistics.median(ours)
    print(
        f"{args.model} batch {args.batch}: FakeTensor counting {mf:.2f} s, gpumem tracer (one full step incl. optimizer) {mo:.2f} s, ratio {mo / mf:.2f}"
    )


if __name__ == "__main__":
    main()
