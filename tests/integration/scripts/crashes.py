"""Crashes with a ValueError after 4 optimizer steps."""

import torch

model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1000):
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    if step == 3:
        raise ValueError("the data ran out of unicorns")
