"""The workload runner: trains one job of the seed's families on a device, with the seed's model,
data and training loop, and prints one JSON line with what PyTorch saw.

    python -m gpumem_trace.run "mlp:input=64,output=10,depth=3" --batch 32 --seconds 60 --device cuda

Output: {"status": "ok" | "oom" | "error", "steps", "seconds", "max_allocated", "max_reserved",
"torch", "cuda", "device", "error"?}. Exit code 0 for ok and oom (an out-of-memory run is a
measurement), 1 for other errors, 2 for a bad spec.
"""

import argparse
import json
import sys
import time

import torch

from . import families

# Spec keys that are loop options, not model arguments.
LOOP_KEYS = {"samples", "summary", "flash"}
BOOLS = {"batchnorm", "pooling", "summary", "flash"}
STRINGS = {"arch", "act", "head"}


def parse_spec(spec):
    """`family:key=value,...` → (family, {key: value}) with the native spec's types."""
    family, _, body = spec.partition(":")
    if family not in ("mlp", "cnn", "transformer") or not body:
        raise ValueError(f"`{spec}` is not a native spec (mlp:..., cnn:..., transformer:...)")
    kw = {}
    for part in body.split(","):
        key, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"`{part}` in `{spec}` is not key=value")
        key = key.strip()
        value = value.strip()
        if key in BOOLS:
            kw[key] = value.lower() in ("true", "1", "yes")
        elif key in STRINGS:
            kw[key] = value
        elif key == "dropout":
            kw[key] = float(value)
        else:
            kw[key] = int(value)
    return family, kw


class RandomSamples(torch.utils.data.Dataset):
    """Samples generated on the fly, as the seed's CNN and Transformer scripts did."""

    def __init__(self, n, make):
        self.n, self.make = n, make

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.make()


def loader(family, kw, batch, samples, device):
    if family == "mlp":
        n = samples or 4096
        x = torch.randn(n, kw["input"])
        y = torch.randint(0, max(kw["output"], 2), (n,))
        return torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, y), batch_size=batch, shuffle=True
        )
    if family == "cnn":
        c, s, k = kw.get("channels", 3), kw["input"], kw["classes"]
        data = RandomSamples(
            samples or 50_000,
            lambda: (torch.randn(c, s, s), torch.randint(0, max(k, 2), ()).item()),
        )
        return torch.utils.data.DataLoader(
            data, batch_size=batch, num_workers=2, pin_memory=device.startswith("cuda")
        )
    v, s, k = kw["vocab"], kw["seq"], kw["classes"]
    data = RandomSamples(
        samples or 50_000, lambda: (torch.randint(0, v, (s,)), torch.randint(0, k, ()).item())
    )
    return torch.utils.data.DataLoader(data, batch_size=batch)


def train(spec, batch, steps, seconds, device):
    family, kw = parse_spec(spec)
    samples, summary = kw.get("samples"), kw.get("summary", False)
    args = {k: v for k, v in kw.items() if k not in LOOP_KEYS}
    model, example, loss_fn = getattr(families, family)(batch, **args)
    model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if summary:
        # The seed's model summary: one forward before training (batch 2 for MLPs, full batch for CNNs).
        rows = 2 if family == "mlp" else batch
        model(example[0][:rows].to(device))
    done, started = 0, time.monotonic()
    while True:
        for x, y in loader(family, kw, batch, samples, device):
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = loss_fn(model(x), (x, y))
            loss.backward()
            opt.step()
            loss.item()
            done += 1
            if (steps and done >= steps) or (seconds and time.monotonic() - started >= seconds):
                return done, time.monotonic() - started


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpumem_trace.run")
    p.add_argument("spec")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    p.add_argument("--seconds", type=float, default=60.0, help="stop after this long (0: no limit)")
    p.add_argument("--device", default="cuda")
    a = p.parse_args(argv)
    if a.steps <= 0 and a.seconds <= 0:
        p.error("set --steps or --seconds")
    out = {"torch": torch.__version__, "cuda": torch.version.cuda or "", "device": a.device}
    cuda = a.device.startswith("cuda")
    if cuda:
        out["device"] = torch.cuda.get_device_name(torch.device(a.device))
    try:
        parse_spec(a.spec)
    except ValueError as e:
        print(f"gpumem_trace.run: {e}", file=sys.stderr)
        return 2
    code = 0
    try:
        steps, secs = train(a.spec, a.batch, a.steps, a.seconds, a.device)
        out.update(status="ok", steps=steps, seconds=round(secs, 3))
    except torch.cuda.OutOfMemoryError as e:
        out.update(status="oom", error=str(e).splitlines()[0])
    except Exception as e:  # noqa: BLE001 - the collector records every failure as a row status
        out.update(status="error", error=f"{type(e).__name__}: {e}".splitlines()[0])
        code = 1
    out["max_allocated"] = torch.cuda.max_memory_allocated() if cuda else 0
    out["max_reserved"] = torch.cuda.max_memory_reserved() if cuda else 0
    print(json.dumps(out), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
