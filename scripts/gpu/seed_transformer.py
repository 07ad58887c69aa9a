"""Issue 18's GPU check of the seed's Transformer rows: the seed's own training script
(itu-rad/GPUMemNet NeuroNetGen_scripts/Transformer/transformer.py), restated, run on a GPU with
PyTorch's allocator history recorded, for rows gpumem misses by about one embedding table
(../shared/data/gpumemnet_transformer_a100_dev.csv lines 7, 50, 71, 28: measured more; 4, 54:
less) and rows it gets right (8, 20). The caching allocator's rules are the same on any GPU (only
cuBLAS's workspaces differ by architecture, by a few MiB), so any GPU shows which table-sized
block the real run could not reuse; set each row's max_reserved beside the replay's reserved
peak (`gpumem estimate SPEC --batch B --gpu h200 --json`: peak − context), context-free.

    python scripts/gpu/seed_transformer.py OUT_DIR [--lines 7 50] [--epochs 2] [--seconds 20]

(about 3 minutes on an H200 for the 8 rows.)

Writes OUT_DIR/seed-transformer.jsonl (one line per row: the row, gpumem's spec, PyTorch's
peaks, the device memory in use at its highest) and OUT_DIR/line-N.pickle (the allocator
snapshot of the setup and the first 30 steps: pytorch.org/memory_viz, or `gpumem diff`). The
seed's `modelsummary` call is restated as what it runs (a forward of the mock batch with shape
hooks) where the package is absent.
"""

import argparse
import json
import pathlib
import re
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

# CSV line -> the row's Filename (the seed's keys, exactly as measured) and Max GPU Memory (MiB).
ROWS = {
    7: ("num_classes:236_embedding_size:256_num_layers:7_num_heads:2_ff_hidden_size:751_dropout_rate:0.33868247251302247_seq_length:128_input_size:679703_num_samples:1472_batch_size:16.out", 6157),
    50: ("num_classes:747_embedding_size:1024_num_layers:4_num_heads:8_ff_hidden_size:2663_dropout_rate:0.35666533190785343_seq_length:128_input_size:948775_num_samples:1408_batch_size:32.out", 25115),
    71: ("num_classes:784_embedding_size:768_num_layers:30_num_heads:12_ff_hidden_size:2688_dropout_rate:0.21155509107090015_seq_length:256_input_size:714487_num_samples:4293_batch_size:16.out", 21463),
    28: ("num_classes:809_embedding_size:768_num_layers:8_num_heads:2_ff_hidden_size:1691_dropout_rate:0.3397448011180911_seq_length:256_input_size:601620_num_samples:4148_batch_size:16.out", 13555),
    4: ("num_classes:265_embedding_size:1024_num_layers:5_num_heads:8_ff_hidden_size:2886_dropout_rate:0.36310239485042184_seq_length:512_input_size:767553_num_samples:4818_batch_size:8.out", 18163),
    54: ("num_classes:820_embedding_size:768_num_layers:25_num_heads:12_ff_hidden_size:2005_dropout_rate:0.254385770187017_seq_length:1024_input_size:336566_num_samples:2310_batch_size:1.out", 9221),
    8: ("num_classes:465_embedding_size:128_num_layers:10_num_heads:2_ff_hidden_size:312_dropout_rate:0.3912709563807849_seq_length:256_input_size:752965_num_samples:3458_batch_size:16.out", 3667),
    20: ("num_classes:369_embedding_size:256_num_layers:7_num_heads:16_ff_hidden_size:548_dropout_rate:0.45428290950604977_seq_length:256_input_size:899791_num_samples:3070_batch_size:8.out", 6153),
}


class TransformerModel(nn.Module):
    """The seed's `standard` architecture."""

    def __init__(self, vocab, embed, layers, heads, ff, dropout, seq, classes):
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.positional_encoding = nn.Parameter(torch.zeros(1, seq, embed, dtype=torch.float32))
        layer = nn.TransformerEncoderLayer(d_model=embed, nhead=heads, dim_feedforward=ff, dropout=dropout, batch_first=True)
        self.model = nn.TransformerEncoder(layer, num_layers=layers)
        self.fc_out = nn.Linear(embed, classes)

    def forward(self, x):
        x = self.embedding(x) + self.positional_encoding
        x = self.model(x)
        return self.fc_out(x.mean(dim=1))


class Samples(Dataset):
    def __init__(self, vocab, seq, n, classes):
        self.vocab, self.seq, self.n, self.classes = vocab, seq, n, classes

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.randint(0, self.vocab, (self.seq,), dtype=torch.long), torch.randint(0, self.classes, (1,), dtype=torch.long).item()


def summary(model, x):
    """modelsummary's `summary(model, x, show_input=True, show_hierarchical=True)`: a forward
    with hooks that keep shapes only."""
    try:
        from modelsummary import summary as seed_summary

        seed_summary(model, x, show_input=True, show_hierarchical=True)
        return
    except ImportError:
        pass
    shapes = []
    hooks = [m.register_forward_hook(lambda m, i, o: shapes.append(list(i[0].size()) if i else None)) for m in model.modules()]
    try:
        model(x)
    finally:
        for h in hooks:
            h.remove()


def keys(filename):
    """The seed's Filename (`num_classes:K_embedding_size:E_..._batch_size:B.out`) as a dict."""
    return {k: float(v) if k == "dropout_rate" else int(v) for k, v in re.findall(r"([a-z_]+?):([0-9.]+?)(?:_|\.out$)", filename)}


# Steps whose allocations the snapshot records (after the seed's two forward passes).
SNAPSHOT_STEPS = 30


def run(line, epochs, device, out, max_steps=0, seconds=20.0):
    filename, measured_mib = ROWS[line]
    f = keys(filename)
    k, e, layers, heads, ff, dropout = f["num_classes"], f["embedding_size"], f["num_layers"], f["num_heads"], f["ff_hidden_size"], f["dropout_rate"]
    seq, vocab, samples, batch = f["seq_length"], f["input_size"], f["num_samples"], f["batch_size"]
    spec = f"transformer:vocab={vocab},embed={e},layers={layers},heads={heads},ff={ff},dropout={dropout},seq={seq},classes={k},samples={samples},summary=true"
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")  # C++ stacks cost seconds
    used = [0]

    def sample():
        if cuda:
            free, total = torch.cuda.mem_get_info()
            used[0] = max(used[0], total - free)

    model = TransformerModel(vocab, e, layers, heads, ff, dropout, seq, k).to(device)
    mock = torch.randint(0, vocab, (batch, seq), dtype=torch.long).to(device)
    model(mock)
    summary(model, mock)
    sample()
    loader = DataLoader(Samples(vocab, seq, samples, k), batch_size=batch, shuffle=True, num_workers=2, pin_memory=cuda)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    model.train()
    steps, started = 0, time.monotonic()
    for _ in range(epochs):
        correct = total = 0
        for inputs, labels in loader:
            inputs, labels = inputs.to(device), labels.to(device)
            optimizer.zero_grad()
            outputs = model(inputs)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()
            loss.item()
            _, predicted = torch.max(outputs, 1)
            correct += (predicted == labels).sum().item()
            total += labels.size(0)
            steps += 1
            sample()
            if cuda and steps == SNAPSHOT_STEPS:
                # The setup and the first steps: where the reserved segments are decided.
                torch.cuda.memory._dump_snapshot(str(out / f"line-{line}.pickle"))
                torch.cuda.memory._record_memory_history(enabled=None)
            if (max_steps and steps >= max_steps) or time.monotonic() - started >= seconds:
                break
        if time.monotonic() - started >= seconds:
            break
    row = {"line": line, "filename": filename, "a100_measured_mib": measured_mib, "spec": spec, "batch": batch, "steps": steps, "seconds": round(time.monotonic() - started, 2), "torch": torch.__version__, "cuda": torch.version.cuda or ""}
    if cuda:
        row.update(
            device=torch.cuda.get_device_name(),
            max_allocated=torch.cuda.max_memory_allocated(),
            max_reserved=torch.cuda.max_memory_reserved(),
            device_used_max=used[0],
            table_bytes=vocab * e * 4,
        )
        if steps < SNAPSHOT_STEPS:
            torch.cuda.memory._dump_snapshot(str(out / f"line-{line}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--lines", type=int, nargs="+", default=sorted(ROWS))
    p.add_argument("--epochs", type=int, default=2, help="two epochs include the short last batch where there is one")
    p.add_argument("--seconds", type=float, default=20.0, help="at most this long per row (the seed stopped at 60 s; the peaks come in the first steps)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=0, help="at most this many steps in all (0: no limit; a smoke test on the CPU)")
    a = p.parse_args()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "seed-transformer.jsonl", "a") as f:
        for line in a.lines:
            try:
                row = run(line, a.epochs, a.device, out, a.steps, a.seconds)
            except Exception as e:  # noqa: BLE001 - one row's failure is that row's result
                row = {"line": line, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
