"""A loop that stops early once its loss is low enough: a branch on a value computed on the GPU."""

import torch

model = torch.nn.Linear(16, 1).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(100):
    x = torch.randn(8, 16).cuda()
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if loss.item() < 1e-3:
        break
