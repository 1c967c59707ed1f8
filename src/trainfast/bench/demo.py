"""`trainfast demo`: the same model, data and steps trained the naive way and the trainfast way, side by side."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from trainfast.bench.hardware import describe, hardware
from trainfast.bench.naive import FloatNormalized, RunStats, naive_fit
from trainfast.data.images import ImageFolder
from trainfast.data.models import build_model
from trainfast.data.splits import open_split
from trainfast.data.synthetic import ensure_demo_dataset
from trainfast.device import resolve_device
from trainfast.loader.make import make_loader
from trainfast.loader.options import Backend
from trainfast.loader.seeding import seed_all
from trainfast.trainer.config import TrainConfig
from trainfast.trainer.loop import Trainer


@dataclass(frozen=True, kw_only=True)
class DemoSpec:
    dataset: str
    epochs: int
    batch_size: int = 64
    image_size: int = 64
    model: str = "convnet"
    lr: float = 2e-3
    weight_decay: float = 0.05
    warmup_steps: int = 10
    grad_clip: float = 1.0
    seed: int = 0


QUICK = DemoSpec(dataset="quick", epochs=3)
FULL = DemoSpec(dataset="default", epochs=2)


def demo_device(device: torch.device | None = None) -> torch.device:
    """The device both sides of a comparison train on: the trainfast side's "auto" (CUDA when there is one).
    Resolved once and handed to both, so that a speedup never compares two devices."""
    return device if device is not None else resolve_device("auto")


def run_trainfast(spec: DemoSpec, root: Path, batches_per_epoch: int, *, decode: str = "draft",
                  channels_last: bool | str = "auto", precision: str = "auto",
                  compile_model: bool | str = False, backend: Backend = "auto",
                  device: torch.device | None = None) -> RunStats:
    """Everything auto; `decode`, `channels_last` and `precision` can be turned back, and compile on or the
    training loader's workers made threads (`backend`), to see what each practice earns. `device`: default
    `demo_device()`."""
    device = demo_device(device)
    seed_all(spec.seed)
    model = build_model(spec.model, num_classes=10, image_size=spec.image_size)
    train = make_loader(open_split(root, "train", image_size=spec.image_size, decode=decode), spec.batch_size,
                        seed=spec.seed, backend=backend, device=device)
    val = make_loader(open_split(root, "val", image_size=spec.image_size, train=False), spec.batch_size,
                      shuffle=False, device=device)
    config = TrainConfig(epochs=spec.epochs, lr=spec.lr, weight_decay=spec.weight_decay, warmup_steps=spec.warmup_steps,
                         grad_clip=spec.grad_clip, seed=spec.seed, limit_batches=batches_per_epoch, cpu_threads="auto",
                         channels_last=channels_last, precision=precision, compile=compile_model, progress=False,
                         device=str(device))
    result = Trainer(model, config=config).fit(train, val)
    return RunStats(name="trainfast", samples_per_s=result.samples_per_s, data_wait_fraction=result.data_wait_fraction,
                    steps=result.steps, final_loss=result.final_loss, val_accuracy=result.val_accuracy,
                    wall_s=result.wall_s, device=str(device), ab_steps=result.ab_steps)


def run_naive(spec: DemoSpec, root: Path, batches_per_epoch: int, *, device: torch.device | None = None) -> RunStats:
    """The tutorials' loop (naive.py) over the same samples: a packed `root` too, then with a full decode of the
    packed JPEGs, in the main process. On the same device as the trainfast side (`demo_device()` by default):
    the tutorials' baseline trains on the GPU too, it only feeds it badly."""
    device = demo_device(device)
    seed_all(spec.seed)
    model = build_model(spec.model, num_classes=10, image_size=spec.image_size)
    train = FloatNormalized(open_split(root, "train", image_size=spec.image_size, decode="full"))
    val = FloatNormalized(open_split(root, "val", image_size=spec.image_size, train=False, decode="full"))
    return naive_fit(model, train, val, epochs=spec.epochs, batches_per_epoch=batches_per_epoch,
                     batch_size=spec.batch_size, lr=spec.lr, weight_decay=spec.weight_decay,
                     warmup_steps=spec.warmup_steps, grad_clip=spec.grad_clip, seed=spec.seed, device=device)


def run_demo(spec: DemoSpec, *, repeats: int = 1, console: Console | None = None,
             device: torch.device | None = None) -> dict[str, Any]:
    """Interleaved naive/trainfast pairs, both on `device` (default `demo_device()`); the speedup is the median of
    the per-pair ratios."""
    console = console or Console()
    device = demo_device(device)
    started = time.perf_counter()
    root = ensure_demo_dataset(spec.dataset, seed=spec.seed)
    console.print(f"demo dataset: {root} (generated or cached in {time.perf_counter() - started:.1f} s)")
    n_train = len(ImageFolder(root / "train"))
    batches_per_epoch = n_train // spec.batch_size  # both runs: exactly these full batches
    pairs: list[tuple[RunStats, RunStats]] = []
    for r in range(repeats):
        console.print(f"[{r + 1}/{repeats}] naive run on {device} ...")
        naive = run_naive(spec, root, batches_per_epoch, device=device)
        console.print(f"[{r + 1}/{repeats}] trainfast run on {device} ...")
        pairs.append((naive, run_trainfast(spec, root, batches_per_epoch, device=device)))
    ratios = [fast.samples_per_s / naive.samples_per_s for naive, fast in pairs]
    median_pair = sorted(pairs, key=lambda p: p[1].samples_per_s / p[0].samples_per_s)[len(pairs) // 2]
    fast = median_pair[1]
    report = {"runs": [median_pair[0].to_json(), fast.to_json()],
              "speedup": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
              "repeats": repeats, "spec": spec.__dict__, "device": str(device), "hardware": hardware(),
              # the trainfast run's A/Bs (the median pair's): each one's steps, and all of them as a share of its steps
              "ab_steps": fast.ab_steps,
              "ab_share": sum(fast.ab_steps.values()) / fast.steps if fast.steps else None}
    console.print(render_table(report))
    return report


def ab_line(report: dict[str, Any]) -> str | None:
    """"A/Bs: precision 6 + channels_last 10 = 16 of 75 steps (21 %)": the trainfast run's A/Bs; None for a report
    without them (written before A/B steps were recorded, or a run whose A/Bs took no step)."""
    steps = {name: n for name, n in (report.get("ab_steps") or {}).items() if n}
    run = next((r for r in report.get("runs", []) if r.get("name") == "trainfast"), None)
    if not steps or run is None or not run.get("steps"):
        return None
    total = sum(steps.values())
    return (f"A/Bs: {' + '.join(f'{name} {n}' for name, n in steps.items())}" + (f" = {total}" if len(steps) > 1
                                                                                   else "")
            + f" of {run['steps']} steps ({total / run['steps']:.0%})")


def render_table(report: dict[str, Any]) -> Table:
    ab = ab_line(report)
    table = Table(title="naive vs trainfast (same model, data, steps and device)",
                  caption=f"{describe(report['hardware'])}\n"
                          f"speedup {report['speedup']:.2f}x samples/s" +
                          (f" (median of {report['repeats']}, range {report['speedup_min']:.2f}-"
                           f"{report['speedup_max']:.2f})" if report["repeats"] > 1 else "") +
                          (f"\n{ab}" if ab else ""))
    for column in ("run", "device", "samples/s", "data wait", "wall time", "final loss", "val accuracy"):
        table.add_column(column, justify="left" if column in ("run", "device") else "right")
    for run in report["runs"]:
        table.add_row(run["name"], run.get("device", "–"), f"{run['samples_per_s']:,.0f}",
                      f"{run['data_wait_fraction']:.0%}", f"{run['wall_s']:.1f} s", f"{run['final_loss']:.3f}",
                      f"{run['val_accuracy']:.1%}")
    return table
