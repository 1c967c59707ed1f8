"""ImageFolder-style JPEG dataset without torchvision, built for loader throughput.

Each sample goes through the shared decode path (`trainfast.data.decode`: DCT-scaled decode, torch's resize, uint8
CHW out). The file list is kept in one numpy byte-string array, not a Python list: workers that read a list of
str objects touch their refcounts and copy the pages (pytorch#13246: RSS grows per worker).

A corrupt or truncated file raises `CorruptImageError` naming it (`on_bad_sample="raise"`), or is logged once
and replaced by the next decodable image (`on_bad_sample="skip"`) until the bad share exceeds `max_bad_fraction`.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from trainfast.data.decode import CorruptImageError, decode_image, image_sample_bytes
from trainfast.loader.prefetch import Normalize

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
OnBadSample = Literal["raise", "skip"]
ON_BAD_SAMPLE: tuple[OnBadSample, ...] = ("raise", "skip")
# on_bad_sample="skip": the most files tried for one sample (the one asked for, then the next ones) before giving up
MAX_FILES_TRIED = 100
# `ImageFolder.skipped`'s shared counters: slot 0 for the main process, one per DataLoader worker id after it
# (wrapping around past 63 workers), so no two processes add to the same slot at once.
SKIPPED_SLOTS = 64

log = logging.getLogger("trainfast")


def list_images(root: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """Class names and (`<class>/<file>`, class index) of `root/<class>/<image>`: classes sorted, then files, the
    order `ImageFolder` and `pack` number samples in. FileNotFoundError when there is no image."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    files = [(f"{name}/{p.name}", label) for label, name in enumerate(classes)
             for p in sorted((root / name).iterdir()) if p.suffix.lower() in IMAGE_SUFFIXES]
    if not files:
        raise FileNotFoundError(f"no images ({', '.join(IMAGE_SUFFIXES)}) under {str(root)!r}; "
                                "expected <root>/<class>/<image>")
    return classes, files


class ImageFolder(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """`root/<class>/<image>` files as `(uint8 CHW tensor, class index)` pairs.

    `train=True`: random-resized crop (area fraction `crop_scale`, aspect 3/4-4/3) and horizontal
    flip, drawn from `batch_rngs().random` (Python's `random`, seeded per batch by the loader; a loader thread's own
    generator with backend="threads", so batches are identical with every backend). `train=False`: resize the
    short side to `image_size / center_fraction`, then a centre crop. `decode="full"` decodes every
    image at its stored size (the reference behaviour, for comparisons).

    A file that cannot be decoded (corrupt, truncated, not an image) raises `CorruptImageError` naming it with
    `on_bad_sample="raise"`. With `"skip"` it is logged (once per file and process), counted in `bad_samples`,
    and the next index's image is returned instead (wrapping around; after `MAX_FILES_TRIED` undecodable files
    in a row, or all of them, `CorruptImageError`). Once more than `max_bad_fraction` of the samples this process
    tried were bad, `CorruptImageError` stops training; the share is judged over at least 1 / max_bad_fraction
    samples (100 at 0.01), so one bad file drawn early is not enough to stop it. Skipping keeps batches independent
    of the worker count (a bad file is decoded again each time it is drawn). Running out of open files or memory
    is not a bad file: that error propagates.

    `bad_samples` and `samples_tried` count in *this process*: DataLoader workers each count their own (the
    main process's counters stay 0, and each worker's limit applies to what that worker tried); the warnings
    name every bad file whichever process met it. `skipped` is the total over the processes: the samples
    replaced by the next image in this process and in the DataLoader workers (fork or spawn) given this dataset,
    kept in a small shared-memory tensor the workers receive with the dataset.
    """

    normalize = Normalize()

    def __init__(self, root: str | Path, *, image_size: int = 64, train: bool = True,
                 decode: str = "draft", crop_scale: tuple[float, float] = (0.35, 1.0),
                 center_fraction: float = 0.875, on_bad_sample: OnBadSample = "raise",
                 max_bad_fraction: float = 0.01) -> None:
        root = Path(root)
        if not root.is_dir():
            raise FileNotFoundError(f"image folder {str(root)!r} does not exist; expected <root>/<class>/<image>")
        if decode not in ("draft", "full"):
            raise ValueError(f"decode={decode!r} is not valid; choose 'draft' or 'full'")
        if image_size < 8:
            raise ValueError(f"image_size={image_size} is too small; use 8 or more")
        if on_bad_sample not in ON_BAD_SAMPLE:
            raise ValueError(f"on_bad_sample={on_bad_sample!r} is not valid; choose 'raise' (stop at the first "
                             "corrupt image) or 'skip' (log it and use the next image)")
        if not (isinstance(max_bad_fraction, (int, float)) and not isinstance(max_bad_fraction, bool)
                and 0 <= max_bad_fraction <= 1):
            raise ValueError(f"max_bad_fraction={max_bad_fraction!r} is not valid; use a number from 0 to 1: the "
                             "share of the samples tried that may be corrupt before training stops (0.01 = 1%, "
                             "1 = skip any number)")
        self.classes, files = list_images(root)
        self.root = root
        # one buffer, no per-item refcounts
        self._paths = np.array([str(root / rel).encode() for rel, _ in files], dtype=bytes)
        self.targets = np.array([label for _, label in files], dtype=np.int64)
        self.image_size, self.train, self.decode = image_size, train, decode
        self.crop_scale, self.center_fraction = crop_scale, center_fraction
        self.on_bad_sample: OnBadSample = on_bad_sample
        self.max_bad_fraction = float(max_bad_fraction)
        self.bad_samples = 0  # decode failures met by this process (a bad file counts each time it is drawn)
        self.samples_tried = 0  # samples this process tried to decode ("skip" mode only)
        self.last_bad_file: str | None = None
        self._bad: dict[str, str] = {}  # path -> why, for the files this process found bad (warned once each)
        self._skipped = _shared_counters(SKIPPED_SLOTS)

    def __len__(self) -> int:
        return len(self._paths)

    @property
    def sample_bytes(self) -> int:
        return image_sample_bytes(self.image_size)

    @property
    def skipped(self) -> int:
        """Samples skipped (`on_bad_sample="skip"`) by this process and the DataLoader workers given this dataset:
        each draw of a corrupt file that was replaced by the next image counts once (0 with "raise")."""
        return int(self._skipped.sum())

    def path(self, index: int) -> str:
        return bytes(self._paths[index]).decode()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self.on_bad_sample == "raise":
            return self._sample(index)
        return self._sample_or_next(index)

    def _sample(self, index: int) -> tuple[torch.Tensor, int]:
        path = self.path(index)
        return decode_image(path, path, image_size=self.image_size, train=self.train, decode=self.decode,
                            crop_scale=self.crop_scale, center_fraction=self.center_fraction), int(self.targets[index])

    def _sample_or_next(self, index: int) -> tuple[torch.Tensor, int]:
        n = len(self)
        start = index % n if -n <= index < n else index  # out of range: let path() raise IndexError
        tries = min(n, MAX_FILES_TRIED)
        for k in range(tries):
            i = (start + k) % n if k else start
            path = self.path(i)
            self.samples_tried += 1
            try:  # a file known to be bad is tried again all the same: skipping it without a decode would
                return self._sample(i)  # change the RNG draws, and a batch must not depend on what came before
            except CorruptImageError as e:
                self._count_bad(path, e)  # raises past max_bad_fraction: not skipped then
                info = torch.utils.data.get_worker_info()
                self._skipped[0 if info is None else 1 + info.id % (SKIPPED_SLOTS - 1)] += 1
        first, last = self.path(start), self.path((start + tries - 1) % n)
        which = f"all {n} files" if tries == n else f"{tries} files in a row"
        raise CorruptImageError(
            f"no decodable image found: {which} from index {start} ({first!r} to {last!r}) failed to decode, the "
            f"last with: {self._bad[last]}. Check the files under {str(self.root)!r} (an "
            "interrupted download or copy, files that are not images); on_bad_sample='skip' only skips occasional "
            "bad files")

    def _count_bad(self, path: str, error: CorruptImageError) -> None:
        """Count a bad sample, warn the first time this process meets the file, stop past `max_bad_fraction`."""
        self.bad_samples += 1
        self.last_bad_file = path
        if path not in self._bad:
            self._bad[path] = str(error.__cause__ or error)
            log.warning("ImageFolder: skipping corrupt image %r (%s); %d bad of %d samples tried in this process "
                        "(pid %d)", path, self._bad[path], self.bad_samples, self.samples_tried, os.getpid())
        limit = self.max_bad_fraction
        least = math.ceil(1 / limit) if limit > 0 else 1
        if self.bad_samples > math.floor(limit * max(self.samples_tried, least) + 1e-9):
            raise CorruptImageError(
                f"too many corrupt images: {self.bad_samples} of the {self.samples_tried} samples this process "
                f"(pid {os.getpid()}) tried ({self.bad_samples / self.samples_tried:.1%}) could not be decoded, "
                f"more than max_bad_fraction={limit:g} ({limit:.1%}; the share is judged over at least {least} "
                f"samples); the last bad file was {path!r}: {error.__cause__ or error}. Fix or remove "
                "the broken "
                "files (each is named in a warning), or raise max_bad_fraction (1 skips any number of them)"
            ) from error


def _shared_counters(slots: int) -> torch.Tensor:
    """`slots` int64 zeros in shared memory: DataLoader workers, forked or spawned, add to the same storage."""
    counters = torch.zeros(slots, dtype=torch.int64)
    try:
        counters.share_memory_()
    except RuntimeError as e:  # no usable /dev/shm: the counts of this process only (workers keep their own)
        log.debug("ImageFolder: no shared memory for the skipped-sample counters (%s); workers' skips not counted", e)
    return counters
