"""`trainfast bench`: the tutorials' before/after tables, measured on this machine.

Three measurements, each row printed as it finishes:

- **workers**: the reference ConvNet trained through `make_loader(workers=n)` + `Trainer` for the same
  number of batches at every `num_workers` from 0 to the usable CPUs; epoch time, samples/s, data wait and
  how busy the device was (GPU utilisation from NVML on CUDA, mean CPU % otherwise).
- **precision**: fp32 vs mixed precision at batch sizes b, 2b, 4b on in-memory synthetic uint8 images
  (compute only, no decode); peak memory (CUDA allocator peak, or the growth of this process's peak RSS on
  the CPU; measured by peak.py) and samples/s. An out-of-memory row is recorded as `"oom": true`, never a crash.
- **naive vs trainfast**: `trainfast demo`'s two runs on the same data, both on the bench's device.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from trainfast.bench.demo import FULL, QUICK, DemoSpec, run_naive, run_trainfast
from trainfast.bench.hardware import hardware
from trainfast.bench.peak import PeakMemory
from trainfast.data.models import build_model
from trainfast.data.packing import INDEX_NAME
from trainfast.data.splits import data_format, has_split, open_split
from trainfast.device import free_memory, resolve_device
from trainfast.host import available_cpus
from trainfast.loader.auto import threads_beside_workers
from trainfast.loader.make import make_loader
from trainfast.loader.prefetch import Normalize
from trainfast.loader.seeding import seed_all
from trainfast.monitor import Monitor, PsutilSource
from trainfast.monitor.sources import NvmlSource
from trainfast.oom import is_oom
from trainfast.precision.policy import device_caps, resolve_precision
from trainfast.trainer.clock import WARMUP_STEPS
from trainfast.trainer.config import TrainConfig
from trainfast.trainer.loop import Trainer
from trainfast.trainer.step import resolve_channels_last
from trainfast.units import format_bytes

log = logging.getLogger("trainfast")
Progress = Callable[[str], None]

# Every worker count up to here; above it a ladder (…, 12, 16, 24, 32, 48, 64, …, N): a 128-CPU host would
# otherwise start 8,000 worker processes over 129 rows, and the table would be too long to read.
FULL_RANGE_WORKERS = 16
UTIL_INTERVAL_S = 0.25  # monitor sampling while the workers rows train
@dataclass(frozen=True, kw_only=True)
class BenchSpec:
    """What `trainfast bench` measures; `QUICK_BENCH` / `FULL_BENCH`, or smaller ones in tests."""

    demo: DemoSpec  # the naive vs trainfast runs (and the demo dataset's size)
    image_size: int = 64
    batch_size: int = 64  # b: the workers rows' batch and the precision table's smallest
    worker_batches: int  # limit_batches for every workers row (the first WARMUP_STEPS are not timed)
    precision_steps: int  # optimizer steps per precision row (the first WARMUP_STEPS are not timed)
    batch_multipliers: tuple[int, ...] = (1, 2, 4)
    workers: tuple[int, ...] | None = None  # None: worker_counts(available_cpus())
    seed: int = 0


QUICK_BENCH = BenchSpec(demo=QUICK, worker_batches=20, precision_steps=12)
FULL_BENCH = BenchSpec(demo=FULL, worker_batches=60, precision_steps=30)


# ---------------------------------------------------------------------------------------------- helpers
def worker_counts(cpus: int) -> list[int]:
    """0..cpus (at least 0..2); past FULL_RANGE_WORKERS a ladder 24, 32, 48, 64, 96, ... that ends at `cpus`."""
    top = max(2, cpus)
    counts = list(range(min(top, FULL_RANGE_WORKERS) + 1))
    k = FULL_RANGE_WORKERS
    while counts[-1] < top:
        for nxt in (k * 3 // 2, k * 2):
            counts.append(min(nxt, top))
            if nxt >= top:
                break
        k *= 2
    return counts


def mixed_precision(device: torch.device) -> str:
    """bf16-mixed where it runs natively (CPU autocast; Ampere+ CUDA), else 16-mixed (pre-Ampere CUDA)."""
    if device.type == "cuda" and not device_caps(device).bf16:
        return "16-mixed"
    return "bf16-mixed"


def workers_precision(device: torch.device) -> str:
    """The workers rows' precision: "auto"'s prior for the device. The rows fix precision and channels_last to
    their priors: a row measures its own setting, not the Trainer's A/Bs of the others."""
    return resolve_precision("auto", device_caps(device)).name


@contextlib.contextmanager
def _quiet(logger: logging.Logger = log) -> Iterator[None]:
    """Per-row INFO lines (what each loader and Trainer chose) would bury the table; warnings still show."""
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def _util(summary: dict[str, Any], device: torch.device) -> tuple[float | None, str]:
    """Mean device utilisation (%): the busiest GPU's NVML util on CUDA (NVML indices ignore
    CUDA_VISIBLE_DEVICES, so the one this process trains on is taken to be the busiest), else mean CPU %."""
    if device.type == "cuda":
        gpus = [s.mean for name, s in summary.items() if re.fullmatch(r"gpu\d+\.util", name)]
        return (max(gpus) if gpus else None), "gpu"
    cpu = summary.get("cpu.percent")
    return (cpu.mean if cpu is not None else None), "cpu"


# ---------------------------------------------------------------------------------------------- (a) workers
def measure_workers(root: Path, *, workers: Sequence[int], batch_size: int = 64, image_size: int = 64,
                    limit_batches: int = 20, seed: int = 0, device: torch.device | None = None,
                    progress: Progress | None = None) -> list[dict[str, Any]]:
    """One row per worker count: the reference ConvNet through make_loader + Trainer for `limit_batches`."""
    device = device or resolve_device("auto")
    classes = len(open_split(root, "train").classes)
    rows = []
    for n in workers:
        free_memory(device)
        row = _workers_row(root, n, classes=classes, batch_size=batch_size, image_size=image_size,
                           limit_batches=limit_batches, seed=seed, device=device)
        rows.append(row)
        if progress is not None:
            progress(_describe_workers_row(row))
    free_memory(device)
    return rows


def _workers_row(root: Path, n: int, *, classes: int, batch_size: int, image_size: int, limit_batches: int,
                 seed: int, device: torch.device) -> dict[str, Any]:
    seed_all(seed)
    model = build_model("convnet", num_classes=classes, image_size=image_size)
    loader = make_loader(open_split(root, "train", image_size=image_size), batch_size, workers=n, seed=seed,
                         device=device)
    per_epoch = len(loader)
    precision = workers_precision(device)
    config = TrainConfig(epochs=1, limit_batches=limit_batches, precision=precision, cpu_threads="auto",
                         channels_last=resolve_channels_last("auto", model, device, precision != "32-true"),
                         device=str(device), progress=False, warmup_steps=min(10, limit_batches), seed=seed)
    threads = threads_beside_workers(available_cpus(), n) if device.type == "cpu" else torch.get_num_threads()
    row: dict[str, Any] = {"num_workers": n, "epoch_s": None, "samples_per_s": None, "data_wait_fraction": None,
                           "util": None, "util_source": "gpu" if device.type == "cuda" else "cpu",
                           "cpu_threads": threads, "batches_measured": min(per_epoch, limit_batches),
                           "batches_per_epoch": per_epoch, "epoch_extrapolated": limit_batches < per_epoch,
                           "wall_s": None, "oom": False, "error": None}
    sources = [PsutilSource(per_core=False)] + ([NvmlSource()] if device.type == "cuda" else [])
    try:
        with Monitor(interval_s=UTIL_INTERVAL_S, sources=sources) as monitor:
            result = Trainer(model, config=config).fit(loader)
    except RuntimeError as e:  # a worker killed (shared memory), memory ran out: a row, not a crash
        row["oom"], row["error"] = is_oom(e), f"{type(e).__name__}: {e}".splitlines()[0]
        return row
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
    util, source = _util(monitor.summary(), device)
    rate = result.samples_per_s
    row.update(samples_per_s=rate, data_wait_fraction=result.data_wait_fraction, util=util, util_source=source,
               epoch_s=per_epoch * batch_size / rate if rate > 0 else None, wall_s=result.wall_s)
    return row


def _describe_workers_row(row: dict[str, Any]) -> str:
    head = f"workers: num_workers={row['num_workers']} (threads {row['cpu_threads']})"
    if row["error"]:
        return f"{head}: failed ({row['error']})"
    util = f", {row['util_source'].upper()} util {row['util']:.0f}%" if row["util"] is not None else ""
    return (f"{head}: {row['samples_per_s']:,.0f} samples/s, data wait {row['data_wait_fraction']:.0%}, "
            f"epoch {row['epoch_s']:.1f} s{util}")


# ---------------------------------------------------------------------------------------------- (b) precision
def synthetic_images(n: int, image_size: int, classes: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random uint8 CHW images and labels, already in memory: the precision table measures compute, not decode."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, 3, image_size, image_size), dtype=torch.uint8, generator=g)
    return x, torch.randint(0, classes, (n,), generator=g)


def measure_precision(*, batch_sizes: Sequence[int], precisions: Sequence[str] | None = None, steps: int = 12,
                      image_size: int = 64, seed: int = 0, device: torch.device | None = None,
                      progress: Progress | None = None) -> list[dict[str, Any]]:
    """fp32 vs mixed precision at each batch size (rows ordered by batch, then precision)."""
    device = device or resolve_device("auto")
    precisions = list(precisions) if precisions is not None else ["32-true", mixed_precision(device)]
    x, y = synthetic_images(max(batch_sizes) * steps, image_size, seed=seed)
    rows: list[dict[str, Any]] = []
    for batch in batch_sizes:
        fp32_rate: float | None = None
        for precision in precisions:
            free_memory(device)
            row = _precision_row(x, y, precision, batch, steps=steps, image_size=image_size, seed=seed,
                                 device=device)
            if precision == "32-true":
                fp32_rate = row["samples_per_s"]
            rate = row["samples_per_s"]
            row["speed_vs_fp32"] = rate / fp32_rate if rate and fp32_rate else None
            rows.append(row)
            if progress is not None:
                progress(_describe_precision_row(row))
    del x, y
    free_memory(device)
    return rows


def _precision_row(x: torch.Tensor, y: torch.Tensor, precision: str, batch: int, *, steps: int, image_size: int,
                   seed: int, device: torch.device) -> dict[str, Any]:
    row: dict[str, Any] = {"precision": precision, "batch_size": batch, "peak_mem_bytes": None,
                           "samples_per_s": None, "oom": False,
                           "mem_source": "cuda" if device.type == "cuda" else "rss", "mem_method": None,
                           "steps": steps, "error": None}
    seed_all(seed)
    peak = PeakMemory(device)
    try:
        model = build_model("convnet", num_classes=10, image_size=image_size)
        loader = make_loader((x, y), batch, workers=0, normalize=Normalize(), seed=seed, device=device)
        config = TrainConfig(epochs=1, limit_batches=steps, precision=precision, cpu_threads="auto",
                             channels_last=resolve_channels_last("auto", model, device, precision != "32-true"),
                             device=str(device), progress=False, warmup_steps=min(10, steps), seed=seed)
        with peak:
            result = Trainer(model, config=config).fit(loader)
    except RuntimeError as e:  # torch.OutOfMemoryError is a RuntimeError too
        if not is_oom(e):
            raise
        row["oom"], row["error"] = True, f"{type(e).__name__}: {e}".splitlines()[0]
        row["mem_method"] = peak.method or None
        return row  # the exception and its frames (holding the row's tensors) are gone before the next row
    row.update(peak_mem_bytes=peak.peak_bytes, samples_per_s=result.samples_per_s, mem_method=peak.method)
    return row


def _describe_precision_row(row: dict[str, Any]) -> str:
    head = f"precision: {row['precision']} batch {row['batch_size']}"
    if row["oom"]:
        return f"{head}: out of memory ({row['error']})"
    speed = f" ({row['speed_vs_fp32']:.2f}x fp32)" if row.get("speed_vs_fp32") and row["precision"] != "32-true" \
        else ""
    return (f"{head}: {row['samples_per_s']:,.0f} samples/s{speed}, peak memory "
            f"{format_bytes(row['peak_mem_bytes'])} ({row['mem_source']})")


# ---------------------------------------------------------------------------------------------- (c) naive vs trainfast
def measure_naive_vs_trainfast(spec: DemoSpec, root: Path, *, progress: Progress | None = None,
                               device: torch.device | None = None) -> dict[str, Any]:
    """`trainfast demo`'s naive and trainfast runs on `root`, both on `device` (default: "auto" resolved);
    {"skipped": reason} where they cannot run.

    Both runs read the same samples: an image folder's JPEG files, or the shards of a packed `root` (the naive run
    then decodes the packed JPEGs in full, in the main process). `reads` says which, for each run."""
    device = device or resolve_device("auto")
    kind = data_format(root)
    train = open_split(root, "train")
    classes = len(train.classes)
    if classes > 10:
        return {"skipped": f"{classes} classes: the demo's runs build a 10-class model"}
    if not has_split(root, "val"):
        missing = str(root / "val" / INDEX_NAME) if kind == "packed" else f"{root / 'val'} folder"
        return {"skipped": f"no {missing}: the demo's runs validate at the end of each epoch"}
    batches = len(train) // spec.batch_size
    if batches < 1:
        return {"skipped": f"fewer training images than one batch of {spec.batch_size}"}
    reads = {"naive": {"format": kind, "decode": "full", "workers": 0},
             "trainfast": {"format": kind, "decode": "draft", "workers": "auto"}}
    if progress is not None:
        data = ", both reading the packed shards" if kind == "packed" else ""
        progress(f"naive vs trainfast: naive run on {device} ({spec.epochs} epochs x {batches} batches{data}) ...")
    naive = run_naive(spec, root, batches, device=device)
    if progress is not None:
        progress(f"naive vs trainfast: naive {naive.samples_per_s:,.0f} samples/s; trainfast run on {device} ...")
    fast = run_trainfast(spec, root, batches, device=device)
    speedup = fast.samples_per_s / naive.samples_per_s if naive.samples_per_s > 0 else None
    if progress is not None:
        progress(f"naive vs trainfast: trainfast {fast.samples_per_s:,.0f} samples/s"
                 + (f", {speedup:.2f}x" if speedup else ""))
    return {"naive": naive.to_json(), "trainfast": fast.to_json(), "speedup": speedup, "reads": reads,
            "spec": {"epochs": spec.epochs, "batches_per_epoch": batches, "batch_size": spec.batch_size,
                     "image_size": spec.image_size, "model": spec.model}}


# ---------------------------------------------------------------------------------------------- all three
def run_bench(spec: BenchSpec, root: Path, *, progress: Progress | None = None, command: str | None = None,
              device: torch.device | None = None) -> dict[str, Any]:
    """All three measurements on `root` (<root>/train/<class>/<image>, val/ optional, or a folder written by
    `trainfast pack`: `data_format` says which); the JSON report."""
    device = device or resolve_device("auto")
    started = time.perf_counter()
    cpus = available_cpus()
    workers = list(spec.workers) if spec.workers is not None else worker_counts(cpus)
    batch_sizes = [spec.batch_size * m for m in spec.batch_multipliers]
    demo = replace(spec.demo, batch_size=spec.batch_size, image_size=spec.image_size, seed=spec.seed)
    with _quiet():
        rows = measure_workers(root, workers=workers, batch_size=spec.batch_size, image_size=spec.image_size,
                               limit_batches=spec.worker_batches, seed=spec.seed, device=device, progress=progress)
        precision = measure_precision(batch_sizes=batch_sizes, steps=spec.precision_steps,
                                      image_size=spec.image_size, seed=spec.seed, device=device, progress=progress)
        versus = measure_naive_vs_trainfast(demo, root, progress=progress, device=device)
    timed = [r for r in rows if r["samples_per_s"]]
    best = max(timed, key=lambda r: r["samples_per_s"]) if timed else None
    return {
        "workers": rows, "precision": precision, "naive_vs_trainfast": versus, "hardware": hardware(),
        "device": str(device), "dataset": str(root), "data_format": data_format(root), "command": command,
        "settings": {"image_size": spec.image_size, "batch_size": spec.batch_size,
                     "worker_batches": spec.worker_batches, "precision_steps": spec.precision_steps,
                     "batch_sizes": batch_sizes, "usable_cpus": cpus, "warmup_steps_excluded": WARMUP_STEPS,
                     "model": "convnet",
                     "workers_precision": workers_precision(device)},
        "best_num_workers": best["num_workers"] if best else None,
        "wall_s": time.perf_counter() - started,
    }
