"""Measures, on a CUDA GPU, what the CPU-side tracer cannot see for CNNs: cuDNN's convolution
workspaces. For each model it trains the tracer's own loop (Adam, fp32, cudnn.benchmark off, as
the seed's scripts ran) for a few steps and writes

- one `step` row per model: peak reserved and allocated bytes, and the device's used memory
  (what nvidia-smi shows) at its highest after a step;
- one `conv` row per convolution: its shapes and the transient bytes its forward and its
  backward needed beyond what they returned (peak allocated inside the call minus allocated
  after it): the workspace cuDNN's chosen engine took.

Usage (a GPU machine, torch + torchvision + timm):
    python python/tools/measure_cnn.py --out cnn.csv [MODEL:BATCH[:CxHxW] ...]
Default: the 12 CNN rows of ../shared/data/paper_realworld_a100_40gb.csv.
"""

import argparse
import csv
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

DEVICE = "cuda"
DEFAULT = [
    "torchvision:vgg16:32", "torchvision:vgg16:128", "torchvision:resnet50:32", "torchvision:resnet50:128",
    "timm:legacy_xception:32", "timm:legacy_xception:128", "torchvision:mobilenet_v2:32", "torchvision:mobilenet_v2:128",
    "torchvision:efficientnet_b0:32", "torchvision:efficientnet_b0:128",
    "torchvision:inception_v3:32:3x299x299", "torchvision:inception_v3:128:3x299x299",
]


def parse(item):
    parts = item.split(":")
    shape = tuple(int(x) for x in parts[3].split("x")) if len(parts) > 3 else (3, 224, 224)
    return f"{parts[0]}:{parts[1]}", int(parts[2]), shape


def measure(ref, batch, shape, steps, rows):
    import torch

    from gpumem_trace.models import resolve

    job = resolve(ref, input_shape=shape, batch_hint=batch)
    model = job.model.to(DEVICE).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    convs = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]
    seen = {}

    def transient(name, phase):
        def start(*_):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

        def end(*_):
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
            seen[(name, phase)] = max(seen.get((name, phase), 0), extra)

        return start, end

    hooks = []
    shapes = {}
    for name, m in convs:
        fs, fe = transient(name, "forward")
        bs, be = transient(name, "backward")
        hooks += [m.register_forward_pre_hook(fs), m.register_forward_hook(fe),
                  m.register_full_backward_pre_hook(bs), m.register_full_backward_hook(be)]
        def record(mod, i, o, n=name):  # a forward hook must return None (else it replaces the output)
            shapes.setdefault(n, (tuple(i[0].shape), tuple(o.shape)))

        hooks.append(m.register_forward_hook(record))
    torch.backends.cudnn.benchmark = False
    used_peak = 0
    for _ in range(steps):
        batch_t = [torch.empty(s, dtype=d, device=DEVICE).normal_() if d.is_floating_point else torch.zeros(s, dtype=d, device=DEVICE)
                   for s, d in job.batch_specs(batch)]
        # Full backward hooks fire at a module's input gradients; the first convolution has
        # none unless the image asks for one (the unhooked step below does not).
        batch_t[0].requires_grad_()
        opt.zero_grad(set_to_none=True)
        loss = job.loss(job.forward(model, batch_t), batch_t)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used_peak = max(used_peak, total - free)
    for h in hooks:
        h.remove()
    # The step's own peaks, without the per-conv resets of the hooked steps.
    torch.cuda.reset_peak_memory_stats()
    batch_t = [torch.zeros(s, dtype=d, device=DEVICE) for s, d in job.batch_specs(batch)]
    opt.zero_grad(set_to_none=True)
    job.loss(job.forward(model, batch_t), batch_t).backward()
    opt.step()
    torch.cuda.synchronize()
    step = {"kind": "step", "model": ref, "batch": batch, "input": "x".join(map(str, shape)),
            "reserved_peak": torch.cuda.max_memory_reserved(), "allocated_peak": torch.cuda.max_memory_allocated(),
            "device_used_peak": used_peak}
    rows.append(step)
    for name, m in convs:
        i, o = shapes.get(name, ((), ()))
        rows.append({"kind": "conv", "model": ref, "batch": batch, "layer": name, "in_shape": "x".join(map(str, i)),
                     "out_shape": "x".join(map(str, o)), "kernel": "x".join(map(str, m.kernel_size)), "stride": m.stride[0],
                     "groups": m.groups, "forward_ws": seen.get((name, "forward"), 0), "backward_ws": seen.get((name, "backward"), 0)})
    del model, opt
    torch.cuda.empty_cache()
    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", default=DEFAULT, help="MODEL:BATCH[:CxHxW]")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("measure_cnn: needs a CUDA GPU (torch.cuda.is_available() is false)", file=sys.stderr)
        return 3
    rows = []
    for item in a.models:
        ref, batch, shape = parse(item)
        step = measure(ref, batch, shape, a.steps, rows)
        print(f"{ref} b{batch}: reserved peak {step['reserved_peak'] / 2**20:.0f} MiB, device used {step['device_used_peak'] / 2**20:.0f} MiB", flush=True)
    keys = ["kind", "model", "batch", "input", "reserved_peak", "allocated_peak", "device_used_peak", "layer", "in_shape",
            "out_shape", "kernel", "stride", "groups", "forward_ws", "backward_ws"]
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
