"""The seeds' "before": the training loop most tutorials start from, kept as the baseline to beat.

Single-process loading (`num_workers=0`), full-size JPEG decode then a PIL resize, a float32 tensor
normalised per sample on the CPU, no pinned memory, fp32, and `loss.item()` every step (a host-device
sync). The optimisation recipe (AdamW, warm-up cosine, clipping) is the same as the Trainer's, so
that only the speed practices differ and the accuracies are comparable.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainfast.data.splits import ImageData
from trainfast.trainer.clock import StepClock
from trainfast.trainer.optimizer import default_optimizer
from trainfast.trainer.schedule import warmup_cosine


class FloatNormalized(Dataset[tuple[torch.Tensor, int]]):
    """torchvision-style samples: float32 in [0, 1], normalised per sample with the folder's mean/std."""

    def __init__(self, folder: ImageData) -> None:
        self.folder = folder
        self.mean = torch.tensor(folder.normalize.mean).view(3, 1, 1)
        self.std = torch.tensor(folder.normalize.std).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        x, y = self.folder[index]
        return (x.float() / 255 - self.mean) / self.std, y


@dataclass(frozen=True)
class RunStats:
    name: str
    samples_per_s: float
    data_wait_fraction: float
    steps: int
    final_loss: float | None
    val_accuracy: float | None
    wall_s: float
    device: str  # where the model trained: a speedup means something only between runs on the same device
    ab_steps: dict[str, int] = field(default_factory=dict)  # the Trainer's A/B steps per practice (naive: none)

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "samples_per_s": self.samples_per_s, "data_wait_fraction": self.data_wait_fraction,
                "steps": self.steps, "final_loss": self.final_loss, "val_accuracy": self.val_accuracy,
                "wall_s": self.wall_s, "device": self.device} | ({"ab_steps": self.ab_steps} if self.ab_steps else {})


def naive_fit(model: nn.Module, train: Dataset[tuple[torch.Tensor, int]], val: Dataset[tuple[torch.Tensor, int]], *,
              epochs: int, batches_per_epoch: int, batch_size: int, lr: float, weight_decay: float,
              warmup_steps: int, grad_clip: float, seed: int, device: torch.device) -> RunStats:
    model = model.to(device)
    loader = DataLoader(train, batch_size=batch_size, shuffle=True, num_workers=0,
                        generator=torch.Generator().manual_seed(seed))
    optimizer = default_optimizer(model, lr, weight_decay, device)
    scheduler = warmup_cosine(optimizer, warmup_steps, epochs * batches_per_epoch)
    clock, started = StepClock(), time.perf_counter()
    losses: list[float] = []
    for _ in range(epochs):
        model.train()
        losses = []
        batches = iter(loader)
        clock.resume()
        for _ in range(batches_per_epoch):
            asked = time.perf_counter()
            inputs, targets = next(batches)
            clock.waited(asked, time.perf_counter())
            inputs, targets = inputs.to(device), targets.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())  # the seeds' per-step host sync
            clock.step_done(len(inputs))
        accuracy = _evaluate(model, val, batch_size, device)
    summary = clock.summary()
    return RunStats(name="naive", samples_per_s=summary.samples_per_s, data_wait_fraction=summary.data_wait_fraction,
                    steps=epochs * batches_per_epoch, final_loss=sum(losses) / len(losses) if losses else None,
                    val_accuracy=accuracy, wall_s=time.perf_counter() - started, device=str(device))


def _evaluate(model: nn.Module, val: Dataset[tuple[torch.Tensor, int]], batch_size: int, device: torch.device) -> float:
    model.eval()
    correct = seen = 0
    with torch.no_grad():
        for inputs, targets in DataLoader(val, batch_size=batch_size, num_workers=0):
            out = model(inputs.to(device))
            correct += int((out.argmax(1) == targets.to(device)).sum().item())
            seen += len(targets)
    return correct / seen
