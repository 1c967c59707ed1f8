"""A heavy model on tensors already in memory, batches sliced by hand (no DataLoader at all)."""

import torch
from torch import nn


def main():
    torch.manual_seed(0)
    x, y = torch.randn(512, 3, 32, 32), torch.randint(0, 10, (512,))
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(1000):
        for i in range(0, 512, 32):
            loss = nn.functional.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
