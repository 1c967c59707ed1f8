"""The demo dataset: learnable classes of procedurally drawn images, stored as JPEG.

Images vary in size (300-500 px on the long side, like ImageNet's typical photos) so that the decode
cost is realistic: a loader that decodes them at full size and then shrinks them does several times
the work one that decodes straight to the training size does. Each class is a shape drawn in a
random colour, size, position and rotation over a noisy gradient; a small ConvNet learns them in a
few hundred steps. Generation is deterministic in (seed, index) and cached.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from trainfast.cache import cache_root
from trainfast.host import affinity_cpus

CLASSES = ("circle", "square", "triangle", "ring", "cross", "star", "diamond", "hexagon",
           "stripes", "dots")
_LAYOUT_VERSION = 1  # bump when the drawing changes, so stale caches are not reused


@dataclass(frozen=True, kw_only=True)
class DemoSize:
    """How many images per class in each split."""

    name: str
    train_per_class: int
    val_per_class: int


SIZES = {
    "quick": DemoSize(name="quick", train_per_class=160, val_per_class=40),
    "default": DemoSize(name="default", train_per_class=1000, val_per_class=100),
}


def demo_dir(size: str = "quick", seed: int = 0) -> Path:
    return cache_root() / f"demo-v{_LAYOUT_VERSION}-{size}-seed{seed}"


def ensure_demo_dataset(size: str | DemoSize = "quick", *, seed: int = 0, root: Path | None = None,
                        processes: int | None = None) -> Path:
    """Return the demo dataset folder (`train/` and `val/` in ImageFolder layout), making it if absent.

    The folder is built under a temporary name and renamed when complete, so an interrupted run never
    leaves a half-made dataset that a later run would trust, and processes that race to make it (one
    per rank under torchrun) all end up using the first complete one.
    """
    if isinstance(size, str) and size not in SIZES:
        raise ValueError(f"unknown demo dataset size {size!r}; valid sizes: {', '.join(SIZES)}")
    spec = SIZES[size] if isinstance(size, str) else size
    target = root if root is not None else demo_dir(spec.name, seed)
    if _complete(target):
        return target
    if target.exists():
        raise FileExistsError(f"{str(target)!r} exists but is not a complete demo dataset (needs train/ and val/); "
                              "delete it to have it generated again")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        jobs = [(staging, split, c, i, seed)
                for split, per_class in (("train", spec.train_per_class), ("val", spec.val_per_class))
                for c in range(len(CLASSES)) for i in range(per_class)]
        for split in ("train", "val"):
            for name in CLASSES:
                (staging / split / name).mkdir(parents=True)
        workers = processes if processes is not None else min(4, affinity_cpus())
        if workers > 1:
            with ProcessPoolExecutor(workers) as pool:
                list(pool.map(_write_one, jobs, chunksize=64))
        else:
            for job in jobs:
                _write_one(job)
        try:
            os.replace(staging, target)
        except OSError:
            if not _complete(target):  # not a lost race: a real failure
                raise
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _complete(folder: Path) -> bool:
    return (folder / "train").is_dir() and (folder / "val").is_dir()


def _write_one(job: tuple[Path, str, int, int, int]) -> None:
    root, split, label, index, seed = job
    # One independent stream per image: the dataset is the same whatever the process count.
    rng = np.random.default_rng([seed, 0 if split == "train" else 1, label, index])
    draw_image(label, rng).save(root / split / CLASSES[label] / f"{index:05d}.jpg", quality=90)


def draw_image(label: int, rng: np.random.Generator) -> Image.Image:
    """One image of class `label`: a shape over a noisy two-colour gradient."""
    long_side = int(rng.integers(300, 501))
    aspect = float(rng.uniform(0.75, 1.0))
    w, h = (long_side, int(long_side * aspect)) if rng.random() < 0.5 else (int(long_side * aspect), long_side)
    c0, c1 = rng.integers(0, 256, size=(2, 3))
    t = np.linspace(0.0, 1.0, w, dtype=np.float32)[None, :, None]
    bg = c0 * (1 - t) + c1 * t + rng.normal(0, 18, size=(h, w, 3)).astype(np.float32)
    img = Image.fromarray(np.clip(bg, 0, 255).astype(np.uint8))
    fg = tuple(int(v) for v in rng.integers(0, 256, size=3))
    cx, cy = w * rng.uniform(0.3, 0.7), h * rng.uniform(0.3, 0.7)
    r = min(w, h) * rng.uniform(0.18, 0.32)
    _draw_shape(ImageDraw.Draw(img), CLASSES[label], cx, cy, r, float(rng.uniform(0, math.pi)), fg)
    return img


def _polygon(cx: float, cy: float, radii: list[float], angle: float) -> list[tuple[float, float]]:
    n = len(radii)
    return [(cx + rr * math.cos(angle + 2 * math.pi * k / n), cy + rr * math.sin(angle + 2 * math.pi * k / n))
            for k, rr in enumerate(radii)]


def _draw_shape(d: ImageDraw.ImageDraw, kind: str, cx: float, cy: float, r: float, angle: float,
                fg: tuple[int, ...]) -> None:
    box = (cx - r, cy - r, cx + r, cy + r)
    if kind == "circle":
        d.ellipse(box, fill=fg)
    elif kind == "ring":
        d.ellipse(box, outline=fg, width=max(3, int(r / 4)))
    elif kind == "square":
        d.polygon(_polygon(cx, cy, [r] * 4, angle), fill=fg)
    elif kind == "diamond":
        d.polygon(_polygon(cx, cy, [r, r * 0.55] * 2, angle), fill=fg)
    elif kind == "triangle":
        d.polygon(_polygon(cx, cy, [r] * 3, angle), fill=fg)
    elif kind == "hexagon":
        d.polygon(_polygon(cx, cy, [r] * 6, angle), fill=fg)
    elif kind == "star":
        d.polygon(_polygon(cx, cy, [r, r * 0.4] * 5, angle), fill=fg)
    elif kind == "cross":
        a = r * 0.3
        for theta in (angle, angle + math.pi / 2):
            dx, dy = math.cos(theta), math.sin(theta)
            px, py = -dy * a, dx * a
            d.polygon([(cx - dx * r + px, cy - dy * r + py), (cx + dx * r + px, cy + dy * r + py),
                       (cx + dx * r - px, cy + dy * r - py), (cx - dx * r - px, cy - dy * r - py)], fill=fg)
    elif kind == "stripes":
        step = r / 3
        dx, dy = math.cos(angle), math.sin(angle)
        for k in range(-3, 4, 2):
            ox, oy = -dy * step * k, dx * step * k
            d.line([(cx + ox - dx * r, cy + oy - dy * r), (cx + ox + dx * r, cy + oy + dy * r)],
                   fill=fg, width=max(2, int(step)))
    elif kind == "dots":
        for px, py in [*_polygon(cx, cy, [r * 0.7] * 5, angle), (cx, cy)]:
            d.ellipse((px - r * 0.18, py - r * 0.18, px + r * 0.18, py + r * 0.18), fill=fg)
    else:  # pragma: no cover - CLASSES and this function change together
        raise ValueError(f"no drawing for class {kind!r}")
