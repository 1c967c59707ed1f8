"""`pack(src, dst)`: an image folder as pre-sized JPEG tar shards (WebDataset layout) plus `index.json`.

Reading millions of small files costs a metadata lookup and an open per sample; `PackedImages` reads a few large
shards through `mmap` instead, and the images are already at training size, so each decode is cheap.

Layout of `dst` (one split; a root with train/ and val/ is packed into dst/train and dst/val):
- `shard-000000.tar`, ...: for each sample `<key>.jpg` (RGB JPEG, shorter side at most `max_size`) then
  `<key>.cls` (the class index as ASCII). The key is the source file's position in the sorted file list,
  zero-padded, so a corrupt source file leaves a gap in the keys instead of renumbering every later shard.
  Tar headers carry no time or owner: the same source and settings give byte-identical shards.
- `index.json` (written atomically, last): see `INDEX_VERSION` and `_index`; per-sample columns `key`, `shard`,
  `offset` (byte offset of the .jpg member's data in its shard), `size`, `label`.
- `.pack-plan.json`: the settings and the sample-to-shard plan, written before the first shard.

Resuming: the plan (how many source files per shard) is decided once, from the sorted file list and the mean
encoded size of a few evenly spaced images, and kept in `.pack-plan.json`; a rerun with the same source and
settings reuses it, keeps every shard already there (each is written under a temporary name, fsynced and
renamed, so one that exists is complete) and writes only the missing ones. A rerun with other settings or
another file list refuses to mix them with the old shards.

A write that fails (a full volume, a quota, permissions; see `trainfast.atomic.write_failure`) raises
`PackWriteError`: the file, the bytes needed and free, the shards kept, and that a rerun finishes the pack.

To an `s3://bucket/prefix` (`trainfast.data.remote`): the pack is made in a local staging folder as above (kept
until the upload ends, so a rerun resumes there too), then each shard is uploaded, `index.json` last, so a reader
never sees an index whose shards are not all there. A rerun skips the shards already uploaded with the right size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import math
import shutil
import sys
import tarfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, BinaryIO

from PIL import Image

from trainfast.atomic import TEMP_PREFIX, atomic_write, describe_write_failure, write_failure, write_json
from trainfast.cache import cache_root
from trainfast.data.decode import RESOURCE_ERRNOS
from trainfast.data.images import list_images
from trainfast.data.remote import DataRoot, ObjectStore, check_scheme
from trainfast.host import available_cpus
from trainfast.units import format_bytes

log = logging.getLogger("trainfast")

INDEX_VERSION = 1
INDEX_NAME = "index.json"
PLAN_NAME = ".pack-plan.json"
SHARD_PATTERN = "shard-{:06d}.tar"
DEFAULT_SHARD_BYTES = 64 << 20
DEFAULT_MAX_SIZE = 256
SPLITS = ("train", "val")
ESTIMATE_SAMPLES = 16  # images encoded up front to estimate the mean encoded size (the shard plan)
KEY_DIGITS = 9


class PackWriteError(RuntimeError):
    """A shard, the plan or the index could not be written (a full volume, a quota, permissions). The message names
    the file, the bytes needed and free, and the shards kept: rerunning the same command writes only the rest."""


@dataclasses.dataclass(frozen=True)
class PackResult:
    """What `pack` did. For a root with train/ and val/, the totals over the splits and each split's own result
    in `splits`."""

    root: DataRoot  # a folder, or the URL packed to
    samples: int  # images in the pack
    shards: int
    shards_written: int  # by this run; the rest were kept from an earlier run
    bytes: int  # total size of the shards
    skipped: tuple[tuple[str, str], ...]  # (source file, why) for each corrupt source image left out
    seconds: float
    splits: dict[str, PackResult] = dataclasses.field(default_factory=dict)
    shards_uploaded: int = 0  # to a URL, by this run; the rest were there already with the right size

    @property
    def shards_kept(self) -> int:
        return self.shards - self.shards_written


def default_max_size(image_size: int | None) -> int:
    return round(1.15 * image_size) if image_size else DEFAULT_MAX_SIZE


def pack(src: str | Path, dst: str | Path, *, max_size: int | None = None, quality: int = 90,
         shard_bytes: int = DEFAULT_SHARD_BYTES, workers: int | None = None, image_size: int | None = None,
         progress: bool = True, staging: str | Path | None = None, retry_s: float | None = None,
         storage_options: dict[str, Any] | None = None) -> PackResult:
    """Pack `src/<class>/<image>` (or `src/train/...` and `src/val/...`) into JPEG tar shards under `dst`.

    Each image is stored as a JPEG whose shorter side is at most `max_size` (default `round(1.15 * image_size)`
    when `image_size` is given, else 256; never upscaled; a JPEG already small enough is kept byte for byte).
    `shard_bytes` is the target shard size (estimated from a few encoded images). `workers` processes (default:
    the usable CPUs) write shards in parallel. A corrupt source image is logged, left out and listed in
    `index.json` and the result. A rerun keeps the shards already written.

    `dst` may be `s3://bucket/prefix`: packed in `staging` (default: a folder under the trainfast cache, removed
    once uploaded), then uploaded shards first, index last; `retry_s` and `storage_options` as for
    `ObjectStore`. An http(s):// `dst` is refused (read-only)."""
    if isinstance(dst, str) and "://" in dst:
        check_scheme(dst)
        store = ObjectStore(dst, writable=True, retry_s=retry_s, storage_options=storage_options)
        stage = Path(staging) if staging is not None else default_staging(store.url)
        local = pack(src, stage, max_size=max_size, quality=quality, shard_bytes=shard_bytes, workers=workers,
                     image_size=image_size, progress=progress)
        uploaded = upload_pack(stage, store, local, progress=progress)
        if staging is None:
            shutil.rmtree(stage, ignore_errors=True)
        return _at_url(local, store.url, uploaded)
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise FileNotFoundError(f"source folder {str(src)!r} does not exist; expected <src>/<class>/<image> "
                                "or <src>/train/<class>/<image>")
    if image_size is not None and image_size < 8:
        raise ValueError(f"image_size={image_size} is too small; use 8 or more")
    size = default_max_size(image_size) if max_size is None else max_size
    if size < 8:
        raise ValueError(f"max_size={size} is too small; use 8 or more (pixels of the shorter side)")
    if not 1 <= quality <= 100:
        raise ValueError(f"quality={quality} is not valid; use 1 to 100 (JPEG quality, 90 by default)")
    if shard_bytes < 1:
        raise ValueError(f"shard_bytes={shard_bytes} is not valid; give a positive number of bytes")
    workers = workers if workers is not None else available_cpus()
    if workers < 1:
        raise ValueError(f"workers={workers} is not valid; use 1 or more")
    settings = {"max_size": size, "quality": quality, "shard_bytes": shard_bytes}
    split_dirs = [s for s in SPLITS if _is_class_root(src / s)] if (src / "train").is_dir() else []
    if not split_dirs:
        return _pack_split(src, dst, settings, workers, progress)
    start = time.perf_counter()
    results = {s: _pack_split(src / s, dst / s, settings, workers, progress) for s in split_dirs}
    return PackResult(root=dst, samples=sum(r.samples for r in results.values()),
                      shards=sum(r.shards for r in results.values()),
                      shards_written=sum(r.shards_written for r in results.values()),
                      bytes=sum(r.bytes for r in results.values()),
                      skipped=tuple(x for r in results.values() for x in r.skipped),
                      seconds=time.perf_counter() - start, splits=results)


def default_staging(url: str) -> Path:
    """Where a pack to `url` is made before its upload: one folder per URL under the trainfast cache."""
    return cache_root() / "pack-staging" / hashlib.sha256(url.encode()).hexdigest()[:16]


def upload_pack(stage: Path, store: ObjectStore, result: PackResult, *, progress: bool = True) -> dict[str, int]:
    """Upload the pack in `stage` (its splits, if any) to `store`: every shard that is not there with the same size,
    then each split's index. An index already there that differs is removed first, so no reader pairs it with
    the new shards. Returns the shards uploaded per split."""
    splits = sorted(result.splits) if result.splits else [""]
    uploaded: dict[str, int] = {}
    for split in splits:
        prefix = f"{split}/" if split else ""
        index = (stage / split / INDEX_NAME).read_bytes()
        if store.exists(prefix + INDEX_NAME) and store.read(prefix + INDEX_NAME) != index:
            store.remove(prefix + INDEX_NAME)
    for split in splits:
        prefix = f"{split}/" if split else ""
        shards = sorted((stage / split).glob("shard-*.tar"))
        uploaded[split] = 0
        for n, shard in enumerate(shards, 1):
            if store.size(prefix + shard.name) != shard.stat().st_size:
                store.write(prefix + shard.name, shard)
                uploaded[split] += 1
            if progress and sys.stderr.isatty():  # one line, rewritten; the summary says the rest
                print(f"\rupload {store.url_of(prefix.rstrip('/'))}: {n}/{len(shards)} shards", end="",
                      file=sys.stderr, flush=True)
        if progress and sys.stderr.isatty():
            print(file=sys.stderr, flush=True)
    for split in splits:  # last: every shard of every split is there
        prefix = f"{split}/" if split else ""
        store.write(prefix + INDEX_NAME, stage / split / INDEX_NAME)
    return uploaded


def _at_url(local: PackResult, url: str, uploaded: dict[str, int]) -> PackResult:
    """`local`, a pack made in a staging folder, as the pack at `url`."""
    splits = {name: _at_url(r, f"{url}/{name}", {"": uploaded[name]}) for name, r in local.splits.items()}
    return dataclasses.replace(local, root=url, splits=splits, shards_uploaded=sum(uploaded.values()))


def _is_class_root(folder: Path) -> bool:
    return folder.is_dir() and any(p.is_dir() for p in folder.iterdir())


def _pack_split(src: Path, dst: Path, settings: dict[str, int], workers: int, progress: bool) -> PackResult:
    start = time.perf_counter()
    classes, files = list_images(src)
    with _no_room(dst, lambda: 4096, "nothing was packed yet"):  # a new folder takes a block (4 KiB on ext4)
        dst.mkdir(parents=True, exist_ok=True)
    for stale in dst.glob(f"{TEMP_PREFIX}shard-*.tmp"):  # left by a run that was killed mid-shard
        stale.unlink(missing_ok=True)
    per_shard, mean_bytes = _plan(src, dst, classes, files, settings)
    ranges = [(i, min(i + per_shard, len(files))) for i in range(0, len(files), per_shard)]
    for extra in dst.glob("shard-*.tar"):  # from a pack with more shards: not part of this one
        number = _shard_number(extra.name)
        if number is None or number >= len(ranges):
            raise FileExistsError(f"{str(dst)!r} holds {extra.name}, which this pack's plan ({len(ranges)} shards) "
                                  "does not have; delete the folder or pack into another one")
    todo = [n for n in range(len(ranges)) if not (dst / SHARD_PATTERN.format(n)).exists()]
    records: dict[int, ShardRecord] = {}
    for n in range(len(ranges)):
        if n not in todo:
            records[n] = _read_shard(dst, n, src, files, ranges[n], settings)
    jobs = [(str(src), str(dst), n, ranges[n], files[ranges[n][0]:ranges[n][1]], settings) for n in todo]
    done_bytes = sum(r.bytes for r in records.values())
    bar = _Progress(dst, len(ranges), len(records), done_bytes, sum(len(r.keys) for r in records.values()), progress)

    def shard_bytes() -> int:  # one shard's size: the mean of those written, else the plan's estimate
        written = [r.bytes for r in records.values()]
        # per sample 2 headers and the .cls (3 tar blocks); then 2 end blocks, padded to a 10 KiB tar record
        planned = per_shard * (mean_bytes + 3 * tarfile.BLOCKSIZE) + 2 * tarfile.BLOCKSIZE
        planned = math.ceil(planned / tarfile.RECORDSIZE) * tarfile.RECORDSIZE
        return round(sum(written) / len(written) if written else planned)

    def kept() -> str:  # once the failed write is over (and the pool has stopped): what is on disk
        done = sum((dst / SHARD_PATTERN.format(n)).exists() for n in range(len(ranges)))
        missing = len(ranges) - done
        bar.close()  # the error message goes on a line of its own
        return (f"{done} of {len(ranges)} shard(s) in {str(dst)!r} are complete and kept; the {missing} missing "
                f"need about {format_bytes(missing * shard_bytes())}: rerun the same command once there is room, it "
                "writes only those")

    if workers == 1 or len(jobs) <= 1:
        for job in jobs:
            with _no_room(dst / SHARD_PATTERN.format(job[2]), shard_bytes, kept):
                record = _write_shard(*job)
            records[record.number] = record
            bar.update(record)
    else:
        with ProcessPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
            futures: dict[Future[ShardRecord], int] = {pool.submit(_write_shard, *job): job[2] for job in jobs}
            for future in as_completed(futures):
                number = futures[future]
                with _no_room(dst / SHARD_PATTERN.format(number), shard_bytes, kept,
                              stop=lambda: pool.shutdown(cancel_futures=True)):  # no more shards into a full volume
                    record = future.result()
                records[record.number] = record
                bar.update(record)
    bar.close()
    ordered = [records[n] for n in range(len(ranges))]
    skipped = tuple(x for r in ordered for x in r.skipped)
    for path, why in skipped:
        log.warning("pack: skipped corrupt image %r (%s)", path, why)
    samples = sum(len(r.keys) for r in ordered)
    if samples == 0:
        raise ValueError(f"none of the {len(files)} images under {str(src)!r} could be decoded")
    index = _index(classes, files, ordered, settings, per_shard, skipped)
    with _no_room(dst / INDEX_NAME, lambda: len(json.dumps(index, indent=2)) + 1,
                  f"All {len(ranges)} shard(s) in {str(dst)!r} are complete and kept: rerun the same command once "
                  f"there is room, it writes only {INDEX_NAME}"):
        write_json(dst / INDEX_NAME, index)
    return PackResult(root=dst, samples=samples, shards=len(ranges), shards_written=len(todo),
                      bytes=sum(r.bytes for r in ordered), skipped=skipped, seconds=time.perf_counter() - start)


@contextlib.contextmanager
def _no_room(path: Path, needed_bytes: Callable[[], int], outcome: str | Callable[[], str],
             stop: Callable[[], None] | None = None) -> Iterator[None]:
    """A failed write of `path` (see `write_failure`) as a `PackWriteError`; `stop` runs first (the other shards'
    writers), `needed_bytes` and `outcome` after it. Any other exception propagates as it is."""
    try:
        yield
    except Exception as e:
        failure = write_failure(e)
        # a process out of files or memory while reading a source image (`_encode` lets those through) is no
        # failed write: it propagates as it is
        if failure is None or failure.errno in RESOURCE_ERRNOS:
            raise
        if stop is not None:
            stop()
        folder = str(path.parent)
        raise PackWriteError(describe_write_failure(
            path, needed_bytes(), failure, outcome if isinstance(outcome, str) else outcome(), what="pack file",
            room_fix=f"free space in {folder!r}, or pack into another folder (a lower --max-size or --quality "
                     "makes smaller shards)",
            other_fix=f"make {folder!r} writable, or pack into another folder")) from e


def _shard_number(name: str) -> int | None:
    stem = name.removeprefix("shard-").removesuffix(".tar")
    return int(stem) if stem.isdigit() else None


def _files_digest(src: Path, classes: Sequence[str], files: Sequence[tuple[str, int]]) -> str:
    """The source's file list, labels and file sizes: another folder with the same names is another source."""
    sizes = [(src / rel).stat().st_size for rel, _ in files]
    h = hashlib.sha256(json.dumps([list(classes), list(files), sizes]).encode())
    return h.hexdigest()


def _plan(src: Path, dst: Path, classes: list[str], files: list[tuple[str, int]],
          settings: dict[str, int]) -> tuple[int, float]:
    """Source files per shard and the estimated mean encoded image size: from `.pack-plan.json` when it matches this
    source and these settings, else estimated (and written there) from the mean encoded size of a few evenly spaced
    images."""
    digest = _files_digest(src, classes, files)
    plan_path = dst / PLAN_NAME
    if plan_path.exists():
        plan = json.loads(plan_path.read_text())
        if plan.get("settings") == settings and plan.get("files_sha256") == digest:
            return int(plan["per_shard"]), float(plan.get("estimated_mean_bytes", 0))
        if any(dst.glob("shard-*.tar")):
            raise FileExistsError(
                f"{str(dst)!r} holds shards packed with other settings or another file list ({plan.get('settings')}, "
                f"{plan.get('files')} files; now {settings}, {len(files)} files); delete the folder or pack into "
                "another one")
    elif any(dst.glob("shard-*.tar")):
        raise FileExistsError(f"{str(dst)!r} holds shards but no {PLAN_NAME}; delete them or pack into another "
                              "folder")
    step = max(1, len(files) // ESTIMATE_SAMPLES)
    sizes = []
    for rel, _ in files[::step][:ESTIMATE_SAMPLES]:
        try:
            sizes.append(len(_encode(src / rel, settings["max_size"], settings["quality"])))
        except _Corrupt:
            continue
    mean = sum(sizes) / len(sizes) if sizes else settings["max_size"] ** 2 / 4
    per_shard = max(1, math.floor(settings["shard_bytes"] / (mean + 3 * tarfile.BLOCKSIZE)))
    plan = {"version": INDEX_VERSION, "settings": settings, "files": len(files), "files_sha256": digest,
            "per_shard": per_shard, "estimated_mean_bytes": round(mean)}
    with _no_room(plan_path, lambda: len(json.dumps(plan, indent=2)) + 1, "No shard was written"):
        write_json(plan_path, plan)
    return per_shard, mean


class _Corrupt(Exception):
    """A source image that cannot be decoded."""


def _encode(path: Path, max_size: int, quality: int) -> bytes:
    """The image as RGB JPEG bytes with its shorter side at most `max_size` (the file's own bytes when it is
    already an RGB JPEG that small). Raises `_Corrupt` for a file that does not decode in full."""
    try:
        data = path.read_bytes()
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
            short = min(w, h)
            if short <= max_size and im.format == "JPEG" and im.mode == "RGB":
                im.load()  # decode in full: a truncated file raises here
                return data
            if short > max_size:
                tw, th = (max_size, round(h * max_size / w)) if w <= h else (round(w * max_size / h), max_size)
                tw, th = max(1, tw), max(1, th)
                im.draft("RGB", (tw, th))
                rgb = im.convert("RGB")
                rgb = rgb.resize((tw, th), Image.Resampling.LANCZOS) if rgb.size != (tw, th) else rgb
            else:
                rgb = im.convert("RGB")
            out = io.BytesIO()
            rgb.save(out, format="JPEG", quality=quality)
            return out.getvalue()
    except OSError as e:
        if e.errno in RESOURCE_ERRNOS:
            raise
        raise _Corrupt(str(e)) from e
    except (SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise _Corrupt(str(e)) from e


@dataclasses.dataclass
class ShardRecord:
    number: int
    keys: list[int]
    offsets: list[int]
    sizes: list[int]
    labels: list[int]
    bytes: int
    skipped: list[tuple[str, str]]


def _member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o444, 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _write_shard(src: str, dst: str, number: int, span: tuple[int, int], files: list[tuple[str, int]],
                 settings: dict[str, int]) -> ShardRecord:
    record = ShardRecord(number, [], [], [], [], 0, [])

    def write(f: BinaryIO) -> None:
        with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for key, (rel, label) in zip(range(*span), files, strict=True):
                path = Path(src) / rel
                try:
                    data = _encode(path, settings["max_size"], settings["quality"])
                except _Corrupt as e:
                    record.skipped.append((str(path), str(e)))
                    continue
                name = f"{key:0{KEY_DIGITS}d}"
                info = _member(f"{name}.jpg", len(data))
                record.keys.append(key)
                record.offsets.append(tar.offset + len(info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")))
                record.sizes.append(len(data))
                record.labels.append(label)
                tar.addfile(info, io.BytesIO(data))
                cls = str(label).encode("ascii")
                tar.addfile(_member(f"{name}.cls", len(cls)), io.BytesIO(cls))

    path = atomic_write(Path(dst) / SHARD_PATTERN.format(number), write)
    record.bytes = path.stat().st_size
    return record


def _read_shard(dst: Path, number: int, src: Path, files: list[tuple[str, int]], span: tuple[int, int],
                settings: dict[str, int]) -> ShardRecord:
    """The record of a shard an earlier run wrote, from its tar headers; the source files of its span that are
    not in it are checked again, so the reason each was skipped is known."""
    path = dst / SHARD_PATTERN.format(number)
    record = ShardRecord(number, [], [], [], [], path.stat().st_size, [])
    with tarfile.open(path, mode="r:") as tar:
        for info in tar:
            stem, _, ext = info.name.partition(".")
            if ext == "jpg":
                record.keys.append(int(stem))
                record.offsets.append(info.offset_data)
                record.sizes.append(info.size)
            elif ext == "cls":
                extracted = tar.extractfile(info)
                assert extracted is not None
                record.labels.append(int(extracted.read().decode("ascii")))
    if len(record.labels) != len(record.keys) or any(not span[0] <= k < span[1] for k in record.keys):
        raise FileExistsError(f"{str(path)!r} does not match this pack's plan (keys {span[0]} to {span[1] - 1}); "
                              "delete the folder or pack into another one")
    present = set(record.keys)
    for key in range(*span):
        if key not in present:
            rel = files[key][0]
            try:
                _encode(src / rel, settings["max_size"], settings["quality"])
                why = "left out by the run that wrote the shard"
            except _Corrupt as e:
                why = str(e)
            record.skipped.append((str(src / rel), why))
    return record


def _index(classes: list[str], files: list[tuple[str, int]], records: list[ShardRecord], settings: dict[str, int],
           per_shard: int, skipped: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    return {
        "format": "trainfast-packed-images",
        "version": INDEX_VERSION,
        "classes": classes,
        "samples": sum(len(r.keys) for r in records),
        "source_files": len(files),
        "shards": [{"name": SHARD_PATTERN.format(r.number), "bytes": r.bytes, "samples": len(r.keys)}
                   for r in records],
        "settings": settings | {"per_shard": per_shard},
        "skipped": [{"path": p, "why": why} for p, why in skipped],
        # per-sample columns, in dataset order
        "key": [k for r in records for k in r.keys],
        "shard": [r.number for r in records for _ in r.keys],
        "offset": [o for r in records for o in r.offsets],
        "size": [s for r in records for s in r.sizes],
        "label": [lb for r in records for lb in r.labels],
    }


class _Progress:
    """One progress line on stderr: rewritten in place on a terminal, a line per shard otherwise."""

    def __init__(self, dst: Path, total: int, done: int, done_bytes: int, samples: int, enabled: bool) -> None:
        self.dst, self.total, self.done, self.bytes, self.samples = dst, total, done, done_bytes, samples
        self.enabled, self.start, self.kept = enabled, time.perf_counter(), done
        self.tty = enabled and sys.stderr.isatty()

    def update(self, record: ShardRecord) -> None:
        self.done += 1
        self.bytes += record.bytes
        self.samples += len(record.keys)
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        kept = f" ({self.kept} kept)" if self.kept else ""
        line = (f"pack {self.dst}: {self.done}/{self.total} shards{kept}, {self.samples:,} images, "
                f"{format_bytes(self.bytes)}, {elapsed:.1f} s")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty and self.done > self.kept:
            print(file=sys.stderr, flush=True)


def iter_members(shard: Path) -> Iterator[tuple[str, int, int]]:
    """(name, data offset, size) of each member of a shard, in order (for checks and tests)."""
    with tarfile.open(shard, mode="r:") as tar:
        for info in tar:
            yield info.name, info.offset_data, info.size
