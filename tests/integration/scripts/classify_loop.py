"""torchvision's ImageNet example, in its shape, without torchvision: an ImageFolder-like dataset over
root/<class>/<img>.jpg with a hand-written RandomResizedCrop + flip + ToTensor + Normalize, a DataLoader,
a small conv net, SGD with momentum and StepLR (or a manual `p.data.add_` update), AverageMeters for the
batch and data times, and a validation pass under torch.no_grad() when --val is given.

Prints its own throughput every --print-freq batches (over the batches since the previous line):
    Epoch: [0][5/5] Time 0.081 (0.085) Data 0.070 (0.073) samples/s 190.2
"""

import argparse
import math
import os
import random
import time

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def random_resized_crop(img, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    width, height = img.size
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * random.uniform(*scale)
        aspect = math.exp(random.uniform(*log_ratio))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            top, left = random.randint(0, height - h), random.randint(0, width - w)
            return img.resize((size, size), Image.BILINEAR, box=(left, top, left + w, top + h))
    side = min(width, height)  # fallback: central crop
    left, top = (width - side) // 2, (height - side) // 2
    return img.resize((size, size), Image.BILINEAR, box=(left, top, left + side, top + side))


def center_crop(img, size, resize=None):
    resize = resize or int(size * 1.14)
    width, height = img.size
    scale = resize / min(width, height)
    img = img.resize((max(resize, round(width * scale)), max(resize, round(height * scale))), Image.BILINEAR)
    width, height = img.size
    left, top = (width - size) // 2, (height - size) // 2
    return img.crop((left, top, left + size, top + size))


def to_tensor(img):
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).float().div(255)


class ImageFolder(Dataset):
    def __init__(self, root, size=64, train=True):
        self.classes = sorted(d.name for d in os.scandir(root) if d.is_dir())
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.samples = [(os.path.join(root, c, f), self.class_to_idx[c]) for c in self.classes
                        for f in sorted(os.listdir(os.path.join(root, c))) if f.lower().endswith((".jpg", ".jpeg"))]
        self.size, self.train = size, train

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        path, target = self.samples[index]
        with open(path, "rb") as f:
            img = Image.open(f).convert("RGB")
        if self.train:
            img = random_resized_crop(img, self.size)
            if random.random() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
        else:
            img = center_crop(img, self.size)
        return (to_tensor(img) - MEAN) / STD, target


class SmallNet(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1))
        self.classifier = nn.Linear(64, num_classes)

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


class AverageMeter:
    def __init__(self, name):
        self.name = name
        self.reset()

    def reset(self):
        self.val = self.avg = self.sum = 0.0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def accuracy(output, target):
    with torch.no_grad():
        return (output.argmax(1) == target).float().mean().item() * 100


class Throughput:
    """Samples/s since the previous report, across epoch boundaries."""

    def __init__(self):
        self.samples, self.since = 0, time.time()

    def add(self, n):
        self.samples += n

    def rate(self):
        now = time.time()
        rate = self.samples / (now - self.since)
        self.samples, self.since = 0, now
        return rate


def train(loader, model, criterion, optimizer, epoch, args, meter):
    batch_time, data_time = AverageMeter("Time"), AverageMeter("Data")
    losses, top1 = AverageMeter("Loss"), AverageMeter("Acc@1")
    model.train()
    end = time.time()
    for i, (images, target) in enumerate(loader):
        data_time.update(time.time() - end)
        output = model(images)
        loss = criterion(output, target)
        losses.update(loss.item(), images.size(0))
        top1.update(accuracy(output, target), images.size(0))
        if optimizer is not None:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        else:
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.data.add_(p.grad, alpha=-args.lr)
        batch_time.update(time.time() - end)
        meter.add(images.size(0))
        end = time.time()
        if (i + 1) % args.print_freq == 0:
            bt, dt = batch_time, data_time
            rate = meter.rate()
            print(f"Epoch: [{epoch}][{i + 1}/{len(loader)}] Time {bt.val:.3f} ({bt.avg:.3f}) "
                  f"Data {dt.val:.3f} ({dt.avg:.3f}) samples/s {rate:.1f} Loss {losses.avg:.3f} "
                  f"Acc@1 {top1.avg:.1f}", flush=True)


def validate(loader, model, criterion):
    model.eval()
    top1 = AverageMeter("Acc@1")
    with torch.no_grad():
        for images, target in loader:
            output = model(images)
            criterion(output, target)
            top1.update(accuracy(output, target), images.size(0))
    print(f" * Acc@1 {top1.avg:.3f}", flush=True)
    return top1.avg


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", help="training images: DIR/<class>/<image>.jpg")
    parser.add_argument("--val", default=None, help="validation images, same layout (validated every epoch)")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--optimizer", choices=["sgd", "manual"], default="sgd")
    parser.add_argument("--print-freq", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    train_dataset = ImageFolder(args.data, args.image_size, train=True)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    val_loader = None
    if args.val:
        val_loader = DataLoader(ImageFolder(args.val, args.image_size, train=False), batch_size=args.batch_size,
                                shuffle=False, num_workers=args.workers)
    model = SmallNet(len(train_dataset.classes))
    criterion = nn.CrossEntropyLoss()
    optimizer = scheduler = None
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum,
                                    weight_decay=args.weight_decay)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
    meter = Throughput()
    best_acc1 = 0.0
    for epoch in range(args.epochs):
        train(train_loader, model, criterion, optimizer, epoch, args, meter)
        if val_loader is not None:
            best_acc1 = max(best_acc1, validate(val_loader, model, criterion))
        if scheduler is not None:
            scheduler.step()


if __name__ == "__main__":
    main()
