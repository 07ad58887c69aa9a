# gpumem from Python, as a notebook would run it (each `# %%` is a cell; in Jupyter an Estimate
# shows its breakdown as a bar chart). Runs on a CPU in seconds:
#     python docs/examples/python-api.py
# (python/tests/test_api.py runs it too, so it stays true.)

# %% A model you hold: sized on a meta copy of it, never touched.
import torch
import torchvision

import gpumem

model = torchvision.models.resnet18()
est = gpumem.estimate(model, batch=64, precision="amp-bf16", gpu="l4")
print(est)  # peak and upper bound as nvidia-smi will show them, and whether it fits
for part, n in sorted(est.breakdown.items(), key=lambda kv: -kv[1])[:4]:
    print(f"  {part:<20} {n / 2**20:8.1f} MiB")
print("peak at:", est.peak_at)


# %% Your own module: give it an example batch (its first output's mean is the loss).
class TwoTower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.users = torch.nn.EmbeddingBag(100_000, 128)
        self.items = torch.nn.Sequential(
            torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128)
        )

    def forward(self, user_ids, item_features):
        return (self.users(user_ids) * self.items(item_features)).sum(-1)


batch = (torch.randint(0, 100_000, (4096, 8)), torch.randn(4096, 512))
print(gpumem.estimate(TwoTower(), batch=4096, input=batch, optimizer="adam", gpu="t4"))

# %% The largest batch that fits, and the fastest setup of a job over two GPUs.
print("max batch on a T4:", gpumem.max_batch(model, input=(3, 224, 224), gpu="t4"))
plan = gpumem.plan(
    "torchvision:resnet18",
    gpu="a100-40gb",
    gpus=2,
    strategies=["ddp", "fsdp"],
    precisions=["amp-bf16"],
    checkpointing="off",
    global_batch=256,
)
print(plan)
print(plan.best)

# %% Mistakes are typed: an InputError is also a ValueError.
try:
    gpumem.estimate(model, batch=64, gpu="no-such-gpu")
except gpumem.InputError as e:
    print("InputError:", e)
