"""Plain helpers shared by test modules (`from helpers import ...`: tests/ is on sys.path, as the folder of the
top conftest). Fixtures live in the conftest files; what is here is imported by name: datasets that 'spawn'
workers unpickle by module and class name, fakes, data makers.
"""

from __future__ import annotations

import random
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import Dataset

from trainfast import TrainConfig, Trainer, make_loader
from trainfast.data import pack
from trainfast.loader.seeding import batch_rngs
from trainfast.loader.tuned import WorkerSettings
from trainfast.tune.trial import Trial

# The three global RNGs an augmentation draws from, in the column order of `Draws(..., GLOBAL_RNGS)`.
GLOBAL_RNGS = ("numpy", "random", "torch")


class Draws(Dataset[torch.Tensor]):
    """Sample i: [i, then one draw from each RNG in `rngs` ("numpy", "random", "torch"), in that order], as an
    augmentation would make. The draws come from the process-global RNGs, or with `per_batch` from the batch's own
    generators (`trainfast.loader.seeding.batch_rngs()`: a loader thread's, elsewhere the globals).

    Module level in a module importable by name, so that 'spawn' workers can unpickle it."""

    def __init__(self, n: int = 22, rngs: Sequence[str] = ("torch",), *, dtype: torch.dtype = torch.float32,
                 per_batch: bool = False) -> None:
        self.n, self.rngs, self.dtype, self.per_batch = n, tuple(rngs), dtype, per_batch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.per_batch:
            rng = batch_rngs()
            draw: dict[str, Callable[[], float]] = {
                "numpy": lambda: float(rng.numpy.rand()), "random": rng.random.random,
                "torch": lambda: float(torch.rand((), generator=rng.torch))}
        else:
            draw = {"numpy": lambda: float(np.random.random()), "random": random.random,
                    "torch": lambda: float(torch.rand(()))}
        return torch.tensor([float(i), *(draw[name]() for name in self.rngs)], dtype=self.dtype)


def assert_same(got: Any, want: Any) -> None:
    """`got` and `want` hold equal tensors in the same nesting of lists and tuples."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want)
    else:
        assert isinstance(got, (list, tuple)) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)


def blobs(n: int = 64, dim: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Four linearly separable classes of `n` points in `dim` dimensions: a few dozen steps reach high accuracy."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    centers = torch.randn(4, dim, generator=g) * 3
    return centers[y] + torch.randn(n, dim, generator=g), y


class Usage(NamedTuple):
    """What `shutil.disk_usage` returns."""

    total: int
    used: int
    free: int


def tick(clock: list[float], seconds: float) -> float:
    """Move the `clock` fixture on by `seconds`; returns the new time."""
    clock[0] += seconds
    return clock[0]


class FakeNVMLError(Exception):
    """The `NVMLError` of a fake pynvml module."""


def fake_pynvml(gpus: int, *, uuid: Callable[[int], str | bytes], bus: Callable[[int], int],
                util: Callable[[int], float], handle: Callable[[int], int] = lambda i: i,
                error: type[Exception] = FakeNVMLError, temperature_gpu: int = 0,
                **pci_info: object) -> types.ModuleType:
    """A stand-in for the pynvml module with `gpus` GPUs: NVML's GPU i has handle `handle(i)` (the identity; one
    that raises is a GPU NVML cannot open), UUID `uuid(i)`, PCI bus `bus(i)` (domain and device 0, and any other
    `pci_info` fields) and utilisation `util(i)` %, read at each sample; 1 of 2 bytes used, 50 °C, 100 W."""
    module: Any = types.ModuleType("pynvml")
    module.NVMLError = error
    module.NVML_TEMPERATURE_GPU = temperature_gpu
    module.nvmlInit = module.nvmlShutdown = lambda: None
    module.nvmlDeviceGetCount = lambda: gpus
    module.nvmlDeviceGetHandleByIndex = handle
    module.nvmlDeviceGetUUID = uuid
    module.nvmlDeviceGetPciInfo = lambda i: types.SimpleNamespace(domain=0, bus=bus(i), device=0, **pci_info)
    module.nvmlDeviceGetUtilizationRates = lambda i: types.SimpleNamespace(gpu=util(i), memory=0)
    module.nvmlDeviceGetMemoryInfo = lambda i: types.SimpleNamespace(used=1, total=2, free=1)
    module.nvmlDeviceGetTemperature = lambda i, sensor: 50
    module.nvmlDeviceGetPowerUsage = lambda i: 100_000
    return module  # type: ignore[no-any-return]


def small_train(tiny_images: Path, *extra: str) -> list[str]:
    """`trainfast train` arguments for a quick run on the tiny dataset: 32 px images, batches of 16, no progress bar."""
    return ["train", "--data", str(tiny_images), "--image-size", "32", "--batch-size", "16", "--no-progress", *extra]


class Sample(NamedTuple):
    """A batch as a namedtuple, the container the loader must hand back as it came."""

    image: torch.Tensor
    label: torch.Tensor


class Images(Dataset[Sample]):
    """`n` random `size` x `size` RGB images (sample i from seed i) as `dtype`, labelled i % `classes`."""

    def __init__(self, n: int = 64, size: int = 8, classes: int = 2, dtype: torch.dtype = torch.uint8) -> None:
        self.n, self.size, self.classes, self.dtype = n, size, classes, dtype

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Sample:
        g = torch.Generator().manual_seed(i)
        image = torch.randint(0, 256, (3, self.size, self.size), generator=g).to(self.dtype)
        return Sample(image, torch.tensor(i % self.classes))


class Scale(nn.Module):
    """`x * w`: no compute to speak of, while a training step holds ~3 batch-sized tensors (the repeated input,
    the gradient of the output, the product for w's gradient), so memory alone decides what fits."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def make_images(root: Path, *, train: int = 8, val: int = 4, size: tuple[int, int] = (24, 20)) -> Path:
    """root/train/<a|b>/<i>.jpg, `train` per class (and root/val/... with `val` per class when val > 0): small JPEGs,
    image i `size` plus i pixels wide. Returns root."""
    for split, per_class in (("train", train), ("val", val)):
        for c, name in enumerate(("a", "b")):
            folder = root / split / name
            for i in range(per_class):
                folder.mkdir(parents=True, exist_ok=True)
                Image.new("RGB", (size[0] + i, size[1]), (25 * i, 120 * c, 90)).save(folder / f"{i}.jpg", quality=90)
    return root


def make_packed(tmp_path: Path, **images: Any) -> Path:
    """tmp_path/packed: `make_images(tmp_path / "src", **images)` packed by `trainfast pack` at 16 px."""
    dst = tmp_path / "packed"
    pack(make_images(tmp_path / "src", **images), dst, image_size=16, shard_bytes=3000, workers=1, progress=False)
    return dst


def fake_measure(rates: dict[int, float], *, per_thread: dict[int, float] | None = None, threads_backend: float = 1.0,
                 unpinned: float = 1.0, prefetch_4: float = 1.0) -> tuple[Callable[[WorkerSettings, float | None],
                                                                              Trial], list[WorkerSettings]]:
    """A tuner trial that measures nothing: throughput by worker count, times an optional bonus by thread count
    (`per_thread`), `threads_backend` for the threads backend, `unpinned` without pinned memory and `prefetch_4` at
    prefetch_factor 4. Returns it and the list of configurations it measured; `measure.beats` lists the `beat` each
    trial was given."""
    calls: list[WorkerSettings] = []
    beats: list[float | None] = []

    def measure(config: WorkerSettings, beat: float | None) -> Trial:
        calls.append(config)
        beats.append(beat)
        rate = rates[min(config.num_workers, max(rates))] * (per_thread or {}).get(config.cpu_threads or 0, 1.0)
        if not config.pin_memory:
            rate *= unpinned
        if config.prefetch_factor == 4:
            rate *= prefetch_4
        if config.backend == "threads":
            rate *= threads_backend
        return Trial(config, rate, 0.1)
    measure.beats = beats  # type: ignore[attr-defined]
    return measure, calls


def train_blobs(ckpt: Path, epochs: int, *, val: bool = False, **overrides: Any) -> Trainer:
    """`Trainer.fit(resume=True)` of a linear model on `blobs()` (batches of 16, seed 0, on the CPU) up to `epochs`,
    checkpointing into `ckpt`; with `val` a validation loader too. `overrides`: more TrainConfig fields."""
    x, y = blobs()
    torch.manual_seed(0)
    config = TrainConfig(epochs=epochs, checkpoint_dir=str(ckpt), progress=False, device="cpu", **overrides)
    trainer = Trainer(nn.Linear(8, 4), config=config)
    trainer.fit(make_loader((x, y), 16), make_loader((x, y), 64, shuffle=False) if val else None, resume=True)
    return trainer


# What torch.save raises when the volume fills up under it (torch 2.13): its C++ zip writer reports the short write
# as a RuntimeError, not an OSError (the first from write_end_of_file on a full tmpfs).
ZIP_WRITER_FULL = ("[enforce fail at inline_container.cc:672] . unexpected pos 2346560 vs 2346452",
                   "PytorchStreamWriter failed writing file data/0: file write failed")
