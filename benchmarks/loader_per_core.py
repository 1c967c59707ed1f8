"""Images per second per core: trainfast's JPEG pipeline vs a torchvision-style PIL pipeline.

Both turn a JPEG file into one training sample (random-resized crop + horizontal flip, the same crop
geometry and the same RNG draws), in one process pinned to one CPU with one torch thread, iterating the
dataset directly (no DataLoader, no workers):

  torchvision-style  full decode, PIL resize of the crop, float32 CHW in [0, 1], normalised per sample
                     (FloatNormalized(ImageFolder(root, image_size=S, decode="full")))
  trainfast          ImageFolder(root, image_size=S): draft decode at the smallest DCT scale (1, 1/2, 1/4,
                     1/8) that still covers the crop at S x S, uint8 CHW out; normalisation happens later,
                     on the device, after batching, and is not counted here

So the comparison is per sample, as each pipeline hands it to batching. Warm-up pass discarded, then
`--repeats` interleaved rounds (alternating order); reported: median images/s of each and the median of
per-round ratios, with spread. FFCV's published per-vCPU rate is printed beside them as an anchor: it
was published by FFCV, not measured here.

    python benchmarks/loader_per_core.py --json loader_per_core.json
    python benchmarks/loader_per_core.py --data /path/to/imagenet/train --images 1000 --sizes 224,128,64
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from trainfast.atomic import write_json
from trainfast.bench.hardware import describe, hardware
from trainfast.bench.naive import FloatNormalized
from trainfast.bench.timing import Spread, interleave, ratios
from trainfast.data.images import ImageFolder, _random_crop
from trainfast.data.synthetic import demo_dir, ensure_demo_dataset

GOAL = 1.5
# Anchor only, never measured here: FFCV's published loading rate per vCPU for decode + random-resized
# crop + flip on ImageNet at low resolution (FFCV's own .beton format and JIT-compiled pipeline).
FFCV_PUBLISHED_PER_VCPU = 326
DEFAULT_SIZES = (224, 128)
SCALES = ("1", "1/2", "1/4", "1/8")


@contextmanager
def one_core(cpu: int) -> Iterator[None]:
    """This process on CPU `cpu` only and torch on one intra-op thread; both restored afterwards."""
    affinity = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, affinity)


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Python's `random` (which draws the crops and flips) seeded, and its previous state restored."""
    state = random.getstate()
    random.seed(seed)
    try:
        yield
    finally:
        random.setstate(state)


def subset(n_total: int, images: int | None, seed: int) -> list[int]:
    """`images` indices drawn without replacement (all of them when None), in a shuffled order."""
    rng = np.random.default_rng(seed)
    count = n_total if images is None else min(images, n_total)
    return [int(i) for i in rng.permutation(n_total)[:count]]


def timed_pass(dataset: Dataset[tuple[torch.Tensor, int]], indices: Sequence[int], seed: int,
               cpu_seconds: list[float]) -> float:
    """Images per second (wall clock) of one pass over `indices`; appends the pass's CPU seconds."""
    with seeded(seed):
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for i in indices:
            _ = dataset[i]
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    cpu_seconds.append(cpu)
    return len(indices) / wall


def _pass(dataset: Dataset[tuple[torch.Tensor, int]], indices: Sequence[int], seed: int,
          cpu_seconds: list[float]) -> Callable[[], float]:
    return lambda: timed_pass(dataset, indices, seed, cpu_seconds)


def draft_scales(folder: ImageFolder, indices: Sequence[int], seed: int) -> dict[str, float]:
    """Share of samples trainfast decodes at each DCT scale, with the draws its timed passes make.

    Replays `ImageFolder`'s draws (crop box, then flip) and asks libjpeg for the draft size on the header
    only: nothing is decoded.
    """
    s, counts = folder.image_size, Counter[str]()
    with seeded(seed):
        for i in indices:
            with Image.open(folder.path(i)) as im:
                w, h = im.size
                _, _, cw, ch = _random_crop(w, h, folder.crop_scale)
                random.random()  # the flip
                if im.format != "JPEG":
                    counts["1"] += 1
                    continue
                im.draft("RGB", (math.ceil(w * s / cw), math.ceil(h * s / ch)))  # as ImageFolder asks
                counts[_scale_name(im.size[0] / w)] += 1
    return {name: counts[name] / len(indices) for name in SCALES if counts[name]}


def _scale_name(factor: float) -> str:
    return min(SCALES, key=lambda name: abs(factor - 1 / int(name.split("/")[-1])))


def measure(root: str | Path, *, sizes: Sequence[int] = DEFAULT_SIZES, images: int | None = 2000, repeats: int = 7,
            warmup: int = 1, seed: int = 0, cpu: int | None = None) -> dict[str, Any]:
    """Per-core images/s of both pipelines at each training size, interleaved; the benchmark's JSON payload."""
    cpu = min(os.sched_getaffinity(0)) if cpu is None else cpu
    probe = ImageFolder(root)
    indices = subset(len(probe), images, seed)
    variants: dict[str, Callable[[], float]] = {}
    cpu_seconds: dict[str, list[float]] = {}
    folders: dict[int, ImageFolder] = {}
    for size in sizes:
        folders[size] = ImageFolder(root, image_size=size)
        pipelines: dict[str, Dataset[tuple[torch.Tensor, int]]] = {
            "torchvision_style": FloatNormalized(ImageFolder(root, image_size=size, decode="full")),
            "trainfast": folders[size]}
        for name, dataset in pipelines.items():
            key = f"{name}@{size}"
            cpu_seconds[key] = []
            variants[key] = _pass(dataset, indices, seed, cpu_seconds[key])
    with one_core(cpu):
        rates = interleave(variants, repeats=repeats, warmup=warmup)
    rows = []
    for size in sizes:
        tv, tf = rates[f"torchvision_style@{size}"], rates[f"trainfast@{size}"]
        ratio = Spread.of(ratios(tf, tv))
        # Per CPU-second: what the rate would be on a core of its own (less sensitive to a shared core).
        tv_cpu, tf_cpu = ([len(indices) / c for c in cpu_seconds[f"{name}@{size}"][warmup:]]
                          for name in ("torchvision_style", "trainfast"))
        shares = [r / c for r, c in zip(tv + tf, tv_cpu + tf_cpu, strict=True)]  # CPU time / wall time per pass
        rows.append({"image_size": size, "trainfast_per_core": Spread.of(tf).median,
                     "torchvision_style_per_core": Spread.of(tv).median, "ratio": ratio.median,
                     "trainfast_per_core_spread": Spread.of(tf).to_json(),
                     "torchvision_style_per_core_spread": Spread.of(tv).to_json(), "ratio_spread": ratio.to_json(),
                     "goal_met": ratio.median >= GOAL,
                     "trainfast_draft_scales": draft_scales(folders[size], indices, seed),
                     "cpu_share": Spread.of(shares).median,
                     "trainfast_per_cpu_s": Spread.of(tf_cpu).median,
                     "torchvision_style_per_cpu_s": Spread.of(tv_cpu).median,
                     "ratio_cpu_time": Spread.of(ratios(tf_cpu, tv_cpu)).median})
    return {"ratio": rows[0]["ratio"], "goal": GOAL, "sizes": rows, "ffcv_published_per_vcpu": FFCV_PUBLISHED_PER_VCPU,
            "images": len(indices), "repeats": repeats, "warmup": warmup, "seed": seed, "cpu": cpu,
            "data": str(Path(root)), "hardware": hardware()}


def resolve_data(data: str | None) -> tuple[Path, float | None]:
    """The ImageFolder root to read (`DIR/train` when it exists, else `DIR`), and the seconds spent
    generating the default demo dataset (None when it was already there or `--data` was given)."""
    if data is not None:
        root = Path(data)
        return (root / "train" if (root / "train").is_dir() else root), None
    existed = (demo_dir("default") / "train").is_dir()
    started = time.perf_counter()
    root = ensure_demo_dataset("default")
    return root / "train", None if existed else time.perf_counter() - started


def render(report: dict[str, Any]) -> str:
    lines = [describe(report["hardware"]),
             f"JPEG -> one training sample (random-resized crop + flip), one process pinned to CPU {report['cpu']}, "
             f"1 torch thread, no DataLoader;",
             f"{report['images']:,} images from {report['data']}, median of {report['repeats']} interleaved rounds "
             f"after {report['warmup']} warm-up pass",
             "",
             f"{'size':>5}  {'torchvision-style':>17}  {'trainfast':>9}  {'ratio (range)':>18}  "
             f"{'goal >= ' + format(GOAL, '.1f') + 'x':>13}  trainfast decode scale"]
    for row in report["sizes"]:
        r = row["ratio_spread"]
        scales = ", ".join(f"{k}: {v:.0%}" if v >= 0.01 else f"{k}: <1%"
                           for k, v in row["trainfast_draft_scales"].items())
        lines.append(f"{row['image_size']:>5}  {row['torchvision_style_per_core']:>11,.0f} img/s  "
                     f"{row['trainfast_per_core']:>9,.0f}  {row['ratio']:>6.2f}x ({r['min']:.2f}-{r['max']:.2f})  "
                     f"{'met' if row['goal_met'] else 'not met':>13}  {scales}")
    share = min(row["cpu_share"] for row in report["sizes"])
    lines.append(f"images/s per core (wall clock); the timed passes were on the CPU {share:.0%}+ of their wall time")
    if share < 0.95:
        lines.append("  the core was shared with other work; per CPU-second instead (torchvision-style / trainfast / "
                     "ratio): " + "; ".join(f"{row['image_size']}: {row['torchvision_style_per_cpu_s']:,.0f} / "
                                            f"{row['trainfast_per_cpu_s']:,.0f} / {row['ratio_cpu_time']:.2f}x"
                                            for row in report["sizes"]))
    lines += ["",
              f"anchor, FFCV's published figure (not measured here): ~{report['ffcv_published_per_vcpu']} images/s "
              "per vCPU,",
              "  decode + random-resized crop + flip, ImageNet at low res, from its own .beton format",
              "Per sample as each pipeline hands it to batching: torchvision-style = float32, normalised here;",
              "trainfast = uint8, normalised later on the device after batching (not counted here)."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None,
                        help="an ImageFolder root (<root>/<class>/<image>, or one with a train/ folder); "
                             "default: the demo dataset ('default' size, generated if absent)")
    parser.add_argument("--images", type=int, default=2000,
                        help="images per pass, a fixed random subset (0: all of them)")
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="training sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cpu", type=int, default=None, help="the CPU to pin to (default: the first allowed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.getLogger("trainfast").setLevel(logging.WARNING)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    root, generated_s = resolve_data(args.data)
    if generated_s is not None:
        print(f"generated the default demo dataset (10,000 train images) in {generated_s:.0f} s (not timed below)")
    report = measure(root, sizes=sizes, images=args.images or None, repeats=args.repeats, seed=args.seed, cpu=args.cpu)
    report["dataset_generation_s"] = generated_s
    print(render(report))
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
