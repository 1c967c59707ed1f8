"""Calls sys.exit(3) after 4 optimizer steps; swallows exceptions like some scripts do."""

import sys

import torch

model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1000):
    try:
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
    except Exception:  # must not swallow the doctor's stop
        pass
    if step == 3:
        sys.exit(3)
