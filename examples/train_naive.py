"""A training loop as most tutorials write it, for `trainfast doctor` to look at:

    trainfast doctor examples/train_naive.py            # the demo dataset (made on first use)
    trainfast doctor examples/train_naive.py -- DIR     # your own DIR/<class>/<image>.jpg

Plain PyTorch: every JPEG decoded at full size then resized, float32 samples normalised one by one,
num_workers=0, fp32. trainfast is imported only to find the demo images.
"""

import argparse
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Jpegs(Dataset):
    def __init__(self, root, size=64):
        self.files = sorted(Path(root).glob("*/*.jpg"))
        self.classes = sorted({f.parent.name for f in self.files})
        self.size = size

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        image = Image.open(self.files[i]).convert("RGB").resize((self.size, self.size))  # full-size decode
        x = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).permute(2, 0, 1)
        return (x - 0.5) / 0.25, self.classes.index(self.files[i].parent.name)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("data", nargs="?", help="DIR/<class>/<image>.jpg (default: trainfast's demo images)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    if args.data is None:
        import trainfast
        args.data = trainfast.ensure_demo_dataset("quick") / "train"
    loader = DataLoader(Jpegs(args.data), batch_size=32, shuffle=True, num_workers=args.workers)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(128, len(loader.dataset.classes)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for epoch in range(args.epochs):
        for step, (x, y) in enumerate(loader):
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % 10 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
