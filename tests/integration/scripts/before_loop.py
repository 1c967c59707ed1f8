"""The seeds' "before" loop: JPEG decode in __getitem__, num_workers=0 by default, .item() every step. --read-ms
makes each read of a file wait that long first (slow storage: a wait that needs no core, so what more workers gain
does not depend on free cores)."""

import argparse
import glob
import os
import time

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset


class JpegDataset(Dataset):
    def __init__(self, root, size=32, read_s=0.0):
        self.files = sorted(glob.glob(os.path.join(root, "*", "*.jpg")))
        self.classes = sorted({os.path.basename(os.path.dirname(f)) for f in self.files})
        self.size, self.read_s = size, read_s

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        if self.read_s:
            time.sleep(self.read_s)
        img = Image.open(self.files[i]).convert("RGB").resize((self.size, self.size))  # full-size decode
        x = torch.from_numpy(np.array(img, dtype=np.float32) / 255).permute(2, 0, 1)
        y = self.classes.index(os.path.basename(os.path.dirname(self.files[i])))
        return (x - 0.5) / 0.25, y


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--context", default=None)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--persistent-workers", action="store_true")
    parser.add_argument("--read-ms", type=float, default=0.0, help="a wait before each file is read")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dataset = JpegDataset(args.data, read_s=args.read_ms / 1e3)
    loader = DataLoader(dataset, batch_size=8, shuffle=True, num_workers=args.workers,
                        multiprocessing_context=args.context if args.workers else None,
                        persistent_workers=args.persistent_workers)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(args.epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            print(f"epoch {epoch} loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
