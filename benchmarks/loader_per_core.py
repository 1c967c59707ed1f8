"""Images per second per core: trainfast's JPEG pipelines vs a torchvision-style PIL pipeline.

Each turns a JPEG into one training sample (random-resized crop + horizontal flip, the same crop geometry
and the same RNG draws), in one process pinned to one CPU with one torch thread, iterating the dataset
directly (no DataLoader, no workers), over the same images in the same order:

  torchvision-style  the original files: full decode, PIL resize of the crop, float32 CHW in [0, 1],
                     normalised per sample (FloatNormalized(ImageFolder(root, image_size=S, decode="full")))
  trainfast          the original files: ImageFolder(root, image_size=S): draft decode at the smallest DCT
                     scale (1, 1/2, 1/4, 1/8) that still covers the crop at S x S, uint8 CHW out;
                     normalisation happens later, on the device, after batching, and is not counted here
  packed             the same images packed once by `trainfast.pack` (tar shards of JPEGs re-encoded with
                     the shorter side at most --pack-max-size, 256 px by default): PackedImages(packed,
                     image_size=S), read by offset from memory-mapped shards, then trainfast's decode path

So the comparison is per sample, as each pipeline hands it to batching. Goals, at 224 px: trainfast on
the original files >= 1.5x torchvision-style, packed >= 2.0x torchvision-style (on the original files).
The pack is made once, outside the timings (its time is printed and recorded), kept in a cache folder
next to the demo dataset (or --packed DIR) and reused while it is of the same source and settings.
Warm-up pass discarded, then `--repeats` interleaved rounds (alternating order); reported: median images/s
of each and the median of per-round ratios, with spread. FFCV's published per-vCPU rate is printed beside
them as an anchor: it was published by FFCV, not measured here.

    python benchmarks/loader_per_core.py --json loader_per_core.json
    python benchmarks/loader_per_core.py --images 300 --repeats 3 --no-packed
    python benchmarks/loader_per_core.py --data /path/to/imagenet/train --images 1000 --sizes 224,128,64 \\
        --packed /path/to/imagenet-packed/train

The whole source folder is packed (the demo's 10,000 images: about a minute on 2 cores; ImageNet: hours),
so for a large one name an existing pack of it with --packed (`trainfast pack` with the same max size and
JPEG quality 90): it is reused as it is.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import math
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from trainfast.atomic import TEMP_PREFIX, write_json
from trainfast.bench.hardware import describe, hardware
from trainfast.bench.naive import FloatNormalized
from trainfast.bench.timing import Spread, interleave, ratios
from trainfast.data.decode import _random_crop
from trainfast.data.images import ImageFolder
from trainfast.data.packed import PackedImages
from trainfast.data.packing import DEFAULT_MAX_SIZE, INDEX_NAME, PLAN_NAME, SHARD_PATTERN, pack
from trainfast.data.synthetic import demo_dir, ensure_demo_dataset

GOAL = 1.5  # trainfast on the original files / torchvision-style
PACKED_GOAL = 2.0  # packed / torchvision-style on the original files
PACK_QUALITY = 90  # pack's default JPEG quality
SOURCE_MARK = ".loader-per-core-source.json"  # in a pack folder: the source and settings it was packed from
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


def draft_scales(folder: ImageFolder | PackedImages, indices: Sequence[int], seed: int,
                 open_image: Callable[[int], str | io.BytesIO] | None = None) -> dict[str, float]:
    """Share of samples trainfast decodes at each DCT scale, with the draws its timed passes make.

    Replays the dataset's draws (crop box, then flip) and asks libjpeg for the draft size on the header
    only: nothing is decoded. `open_image(i)`: sample i's file (default: `folder.path(i)`, an ImageFolder's).
    """
    s, counts = folder.image_size, Counter[str]()
    opener = folder.path if open_image is None else open_image
    with seeded(seed):
        for i in indices:
            with Image.open(opener(i)) as im:
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


@dataclass(frozen=True)
class Packed:
    """The benchmark's pack of its source folder (`ensure_packed`)."""

    root: Path
    max_size: int
    quality: int
    samples: int
    shards: int
    bytes: int
    source_files: int
    source_bytes: int
    skipped: int  # source files pack could not decode (left out)
    seconds: float | None  # this run's packing time; None: an earlier run's pack was reused as it was

    def to_json(self) -> dict[str, Any]:
        return {"root": str(self.root), "max_size": self.max_size, "quality": self.quality, "samples": self.samples,
                "shards": self.shards, "bytes": self.bytes, "source_files": self.source_files,
                "source_bytes": self.source_bytes, "bytes_vs_source": self.bytes / self.source_bytes,
                "skipped": self.skipped}


def default_packed_dir(source: str | Path, max_size: int = DEFAULT_MAX_SIZE, quality: int = PACK_QUALITY) -> Path:
    """The pack folder of `source`, next to the demo dataset: named by the source's path and the settings, so
    packs of two sources or two max sizes never share a folder."""
    source = Path(source).resolve()
    digest = hashlib.sha256(str(source).encode()).hexdigest()[:8]
    return demo_dir("default").parent / f"packed-{source.parent.name}-{source.name}-{digest}-max{max_size}-q{quality}"


def ensure_packed(source: str | Path, dst: str | Path, *, max_size: int = DEFAULT_MAX_SIZE,
                  quality: int = PACK_QUALITY, progress: bool = True) -> Packed:
    """`source` (an ImageFolder root) packed into `dst`, shorter side at most `max_size`; an earlier pack there of
    the same source and settings is reused (pack keeps complete shards and checks the file list and settings;
    the mark file adds the source's path and size, which the file list does not cover). Any other pack there is
    removed (pack's own files only) and `source` packed again."""
    source, dst = Path(source).resolve(), Path(dst)
    files = ImageFolder(source)  # pack's order too: classes sorted, then files
    source_bytes = sum(os.stat(files.path(i)).st_size for i in range(len(files)))
    mark = {"source": str(source), "files": len(files), "bytes": source_bytes, "max_size": max_size,
            "quality": quality}
    if (dst / SOURCE_MARK).is_file() and json.loads((dst / SOURCE_MARK).read_text()) != mark:
        _remove_pack(dst)
    try:
        result = pack(source, dst, max_size=max_size, quality=quality, progress=progress)
    except FileExistsError:  # shards of another file list or other settings: pack refuses to mix them
        _remove_pack(dst)
        result = pack(source, dst, max_size=max_size, quality=quality, progress=progress)
    if result.splits:
        raise ValueError(f"{str(source)!r} holds train/ or val/ class folders: give the split's folder itself")
    write_json(dst / SOURCE_MARK, mark)
    return Packed(root=result.root, max_size=max_size, quality=quality, samples=result.samples, shards=result.shards,
                  bytes=result.bytes, source_files=len(files), source_bytes=source_bytes, skipped=len(result.skipped),
                  seconds=result.seconds if result.shards_written else None)


def _remove_pack(dst: Path) -> None:
    """The files pack (and `ensure_packed`) wrote in `dst`, index first, and nothing else: --packed may name a
    folder that holds more."""
    for path in [dst / INDEX_NAME, dst / PLAN_NAME, dst / SOURCE_MARK, *dst.glob("shard-*.tar"),
                 *dst.glob(f"{TEMP_PREFIX}shard-*.tmp")]:
        path.unlink(missing_ok=True)


class PackIndex:
    """A pack's `index.json` (per-sample columns, as packing.py documents them): which source file each sample
    is, and its stored JPEG."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        index = json.loads((self.root / INDEX_NAME).read_text())
        self.classes: list[str] = index["classes"]
        self.source_files: int = index["source_files"]
        self.keys: list[int] = index["key"]
        self.labels: list[int] = index["label"]
        self.shards: list[int] = index["shard"]
        self.offsets: list[int] = index["offset"]
        self.sizes: list[int] = index["size"]

    def positions(self, folder: ImageFolder, indices: Sequence[int]) -> list[int]:
        """The pack's index of each of `folder`'s `indices`. A sample's key is its file's position in the sorted
        source list (ImageFolder's order), and a file pack could not decode leaves a gap in the keys: past a gap,
        sample i of the pack is not file i of the folder."""
        if self.classes != folder.classes or self.source_files != len(folder):
            raise ValueError(f"the pack in {str(self.root)!r} ({self.source_files} files, classes {self.classes[:3]}"
                             f"...) is not of {str(folder.root)!r} ({len(folder)} files); pack it again")
        where = {key: j for j, key in enumerate(self.keys)}
        missing = [i for i in indices if i not in where]
        if missing:
            raise ValueError(f"the pack left out {len(missing)} of the benchmark's images (corrupt source files), "
                             f"e.g. {folder.path(missing[0])!r}")
        out = [where[i] for i in indices]
        if any(self.labels[j] != int(folder.targets[i]) for i, j in zip(indices, out, strict=True)):
            raise ValueError(f"the pack in {str(self.root)!r} labels its images unlike {str(folder.root)!r}")
        return out

    def open(self, j: int) -> io.BytesIO:
        """Sample j's stored JPEG."""
        with open(self.root / SHARD_PATTERN.format(self.shards[j]), "rb") as f:
            f.seek(self.offsets[j])
            return io.BytesIO(f.read(self.sizes[j]))


def measure(root: str | Path, *, sizes: Sequence[int] = DEFAULT_SIZES, images: int | None = 2000, repeats: int = 7,
            warmup: int = 1, seed: int = 0, cpu: int | None = None, packed: Packed | None = None) -> dict[str, Any]:
    """Per-core images/s of the pipelines at each training size, interleaved (the packed one too when `packed`,
    `root` packed by `ensure_packed`, is given); the benchmark's JSON payload."""
    cpu = min(os.sched_getaffinity(0)) if cpu is None else cpu
    probe = ImageFolder(root)
    indices = subset(len(probe), images, seed)
    index = PackIndex(packed.root) if packed is not None else None
    packed_indices = index.positions(probe, indices) if index is not None else []  # the same images, same order
    variants: dict[str, Callable[[], float]] = {}
    cpu_seconds: dict[str, list[float]] = {}
    folders: dict[int, ImageFolder] = {}
    packs: dict[int, PackedImages] = {}
    for size in sizes:
        folders[size] = ImageFolder(root, image_size=size)
        pipelines: dict[str, tuple[Dataset[tuple[torch.Tensor, int]], Sequence[int]]] = {
            "torchvision_style": (FloatNormalized(ImageFolder(root, image_size=size, decode="full")), indices),
            "trainfast": (folders[size], indices)}
        if packed is not None:
            packs[size] = PackedImages(packed.root, image_size=size)
            pipelines["packed"] = (packs[size], packed_indices)
        for name, (dataset, order) in pipelines.items():
            key = f"{name}@{size}"
            cpu_seconds[key] = []
            variants[key] = _pass(dataset, order, seed, cpu_seconds[key])
    with one_core(cpu):
        rates = interleave(variants, repeats=repeats, warmup=warmup)
    names = ["torchvision_style", "trainfast"] + (["packed"] if packed is not None else [])
    rows = []
    for size in sizes:
        rate = {name: rates[f"{name}@{size}"] for name in names}
        # Per CPU-second: what the rate would be on a core of its own (less sensitive to a shared core).
        per_cpu = {name: [len(indices) / c for c in cpu_seconds[f"{name}@{size}"][warmup:]] for name in names}
        tv, tf = rate["torchvision_style"], rate["trainfast"]
        tv_cpu, tf_cpu = per_cpu["torchvision_style"], per_cpu["trainfast"]
        ratio = Spread.of(ratios(tf, tv))
        shares = [r / c for name in names for r, c in zip(rate[name], per_cpu[name], strict=True)]  # CPU / wall
        row = {"image_size": size, "trainfast_per_core": Spread.of(tf).median,
               "torchvision_style_per_core": Spread.of(tv).median, "ratio": ratio.median,
               "trainfast_per_core_spread": Spread.of(tf).to_json(),
               "torchvision_style_per_core_spread": Spread.of(tv).to_json(), "ratio_spread": ratio.to_json(),
               "goal_met": ratio.median >= GOAL,
               "trainfast_draft_scales": draft_scales(folders[size], indices, seed),
               "cpu_share": Spread.of(shares).median,
               "trainfast_per_cpu_s": Spread.of(tf_cpu).median,
               "torchvision_style_per_cpu_s": Spread.of(tv_cpu).median,
               "ratio_cpu_time": Spread.of(ratios(tf_cpu, tv_cpu)).median}
        if index is not None:
            pk, pk_cpu = rate["packed"], per_cpu["packed"]
            packed_ratio = Spread.of(ratios(pk, tv))
            row |= {"packed_per_core": Spread.of(pk).median, "packed_per_core_spread": Spread.of(pk).to_json(),
                    "packed_ratio": packed_ratio.median, "packed_ratio_spread": packed_ratio.to_json(),
                    "packed_goal": PACKED_GOAL, "packed_goal_met": packed_ratio.median >= PACKED_GOAL,
                    "packed_vs_trainfast": Spread.of(ratios(pk, tf)).median,
                    "packed_draft_scales": draft_scales(packs[size], packed_indices, seed, index.open),
                    "packed_per_cpu_s": Spread.of(pk_cpu).median,
                    "packed_ratio_cpu_time": Spread.of(ratios(pk_cpu, tv_cpu)).median}
        rows.append(row)
    return {"ratio": rows[0]["ratio"], "goal": GOAL, "packed_ratio": rows[0].get("packed_ratio"),
            "packed_goal": PACKED_GOAL, "sizes": rows, "ffcv_published_per_vcpu": FFCV_PUBLISHED_PER_VCPU,
            "images": len(indices), "repeats": repeats, "warmup": warmup, "seed": seed, "cpu": cpu,
            "data": str(Path(root)), "packed": packed.to_json() if packed is not None else None,
            "pack_seconds": packed.seconds if packed is not None else None, "hardware": hardware()}


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


def _scales(shares: dict[str, float]) -> str:
    return ", ".join(f"{k}: {v:.0%}" if v >= 0.01 else f"{k}: <1%" for k, v in shares.items())


def render(report: dict[str, Any]) -> str:
    packed = report.get("packed")
    goal, packed_goal = (f"goal >= {g:.1f}x" for g in (GOAL, report.get("packed_goal", PACKED_GOAL)))
    lines = [describe(report["hardware"]),
             f"JPEG -> one training sample (random-resized crop + flip), one process pinned to CPU {report['cpu']}, "
             f"1 torch thread, no DataLoader;",
             f"{report['images']:,} images from {report['data']}, median of {report['repeats']} interleaved rounds "
             f"after {report['warmup']} warm-up pass",
             "",
             f"{'size':>5}  {'torchvision-style':>17}  {'trainfast':>9}  {'ratio (range)':>18}  {goal:>13}"
             + (f"  {'packed':>7}  {'ratio (range)':>18}  {packed_goal:>13}" if packed else "")
             + "  trainfast decode scale"]
    for row in report["sizes"]:
        r = row["ratio_spread"]
        line = (f"{row['image_size']:>5}  {row['torchvision_style_per_core']:>11,.0f} img/s  "
                f"{row['trainfast_per_core']:>9,.0f}  {row['ratio']:>6.2f}x ({r['min']:.2f}-{r['max']:.2f})  "
                f"{'met' if row['goal_met'] else 'not met':>13}")
        if packed:
            p = row["packed_ratio_spread"]
            line += (f"  {row['packed_per_core']:>7,.0f}  {row['packed_ratio']:>6.2f}x ({p['min']:.2f}-{p['max']:.2f})"
                     f"  {'met' if row['packed_goal_met'] else 'not met':>13}")
        lines.append(f"{line}  {_scales(row['trainfast_draft_scales'])}")
    share = min(row["cpu_share"] for row in report["sizes"])
    lines.append(f"images/s per core (wall clock); the timed passes were on the CPU {share:.0%}+ of their wall time")
    if share < 0.95:
        names = "torchvision-style / trainfast / ratio" + (" / packed / ratio" if packed else "")
        lines.append(f"  the core was shared with other work; per CPU-second instead ({names}): " + "; ".join(
            f"{row['image_size']}: {row['torchvision_style_per_cpu_s']:,.0f} / {row['trainfast_per_cpu_s']:,.0f} / "
            f"{row['ratio_cpu_time']:.2f}x"
            + (f" / {row['packed_per_cpu_s']:,.0f} / {row['packed_ratio_cpu_time']:.2f}x" if packed else "")
            for row in report["sizes"]))
    if packed:
        made = (f"packed in {report['pack_seconds']:.0f} s by this run" if report["pack_seconds"] is not None
                else "reused from an earlier run")
        lines += ["",
                  f"packed: {packed['root']}",
                  f"  {made} (not timed above): shorter side <= {packed['max_size']} px, JPEG quality "
                  f"{packed['quality']}, {packed['samples']:,} images in {packed['shards']} shards,",
                  f"  {packed['bytes'] / 2**20:,.1f} MiB ({packed['bytes_vs_source']:.0%} of the source's "
                  f"{packed['source_bytes'] / 2**20:,.1f} MiB)",
                  "  packed decode scale: " + "; ".join(f"{row['image_size']}: {_scales(row['packed_draft_scales'])}"
                                                        for row in report["sizes"]),
                  "  packed / trainfast on the original files: " + ", ".join(
                      f"{row['image_size']}: {row['packed_vs_trainfast']:.2f}x" for row in report["sizes"])]
    lines += ["",
              f"anchor, FFCV's published figure (not measured here): ~{report['ffcv_published_per_vcpu']} images/s "
              "per vCPU,",
              "  decode + random-resized crop + flip, ImageNet at low res, from its own .beton format",
              "Per sample as each pipeline hands it to batching: torchvision-style = float32, normalised here;",
              "trainfast and packed = uint8, normalised later on the device after batching (not counted here)."]
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
    parser.add_argument("--packed", default=None, metavar="DIR",
                        help="the folder of the packed pipeline's pack of the data, made if absent, reused when it is "
                             "of the same data and settings, packed again otherwise (default: a folder per data and "
                             "settings next to the demo dataset)")
    parser.add_argument("--pack-max-size", type=int, default=DEFAULT_MAX_SIZE,
                        help="the packed images' shorter side at most, in pixels")
    parser.add_argument("--no-packed", action="store_true", help="leave out the packed pipeline")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.getLogger("trainfast").setLevel(logging.WARNING)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    root, generated_s = resolve_data(args.data)
    if generated_s is not None:
        print(f"generated the default demo dataset (10,000 train images) in {generated_s:.0f} s (not timed below)")
    packed = None
    if not args.no_packed:
        dst = Path(args.packed) if args.packed else default_packed_dir(root, args.pack_max_size)
        packed = ensure_packed(root, dst, max_size=args.pack_max_size)
        if packed.seconds is not None:
            print(f"packed {packed.samples:,} images (shorter side <= {packed.max_size} px) into {packed.root} in "
                  f"{packed.seconds:.0f} s (not timed below)")
    report = measure(root, sizes=sizes, images=args.images or None, repeats=args.repeats, seed=args.seed, cpu=args.cpu,
                     packed=packed)
    report["dataset_generation_s"] = generated_s
    print(render(report))
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
