"""`PackedImages`: the shards `trainfast pack` writes, read by offset from memory-mapped files, or by byte range
from a URL (`http(s)://`, `s3://`: see `trainfast.data.remote`).

Each sample is the same `(uint8 CHW tensor, class index)` `ImageFolder` returns for the same options, through the
same decode (`decode_image`): only where the JPEG bytes come from differs. Shards are opened lazily, once per
shard and process (under a lock: loader threads share them); the maps are never pickled, so each DataLoader worker
(fork or spawn) opens its own.

From a URL, a batch (`__getitems__`, which the loaders call) waits about one round-trip: a shard it reads
`WHOLE_SHARD_SAMPLES` or more samples of is fetched whole, once, and kept (at most `CACHE_BYTES` of whole shards a
process, the least recently used dropped; a shard larger than that is always read by ranges); its other samples' byte
ranges are requested all at once. `make_loader` visits remote shards a window of two at a time (`read_groups`,
loader/batches.py), each rank and each loader process its own shards, so each shard is fetched whole about once an
epoch in all instead of one request per sample: measured on a local S3 server, a ranged request costs ~1.6 ms of
client CPU (signing, aiohttp) and ~3 ms of the server's, 110 ms a batch of 64, which the training pays on the same
cores.
"""

from __future__ import annotations

import io
import json
import logging
import mmap
import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainfast.data.decode import CorruptImageError, decode_image, image_sample_bytes
from trainfast.data.packing import DEFAULT_SHARD_BYTES, INDEX_NAME, INDEX_VERSION, KEY_DIGITS, SHARD_PATTERN
from trainfast.data.remote import DataRoot, ObjectStore, RemoteStorageError, check_scheme, is_url, join
from trainfast.loader.prefetch import Normalize

log = logging.getLogger("trainfast")

# From a URL: a shard a batch reads this many samples of is fetched whole (one request for all its samples), and
# so is any shard this small, which costs about what one request does
WHOLE_SHARD_SAMPLES = 4
SMALL_SHARD_BYTES = 4 << 20
# Bytes of whole shards kept per process (each DataLoader worker has its own cache; loader threads share theirs):
# two windows of the loader's order (2 shards each) at pack's default 64 MiB shard size, so a batch crossing from
# one window to the next finds all four. A bound in bytes, not shards: memory is then known whatever the shard size.
CACHE_BYTES = 4 * DEFAULT_SHARD_BYTES


class PackedImages(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """A folder written by `trainfast pack` (`root/index.json` and `root/shard-*.tar`) as `(uint8 CHW tensor,
    class index)` pairs, with `ImageFolder`'s augmentation options (`image_size`, `train`, `decode`,
    `crop_scale`, `center_fraction`).

    `root` may be a URL, `http(s)://host/prefix` or `s3://bucket/prefix` (the `remote` extra): `retry_s` bounds
    the retries of a failing request (default `$TRAINFAST_REMOTE_RETRY_S`, else 30 s), then `RemoteStorageError`;
    `storage_options` go to fsspec (s3: `endpoint_url`, `key`, `secret`, ...).

    Memory from a URL: each process (the main one, or each DataLoader worker: with 4 workers per rank, 4 caches)
    keeps at most `cache_bytes` of whole shards (default `CACHE_BYTES`, 256 MiB), the least recently used
    dropped; a shard larger than that is read by byte ranges instead, never whole. Beyond it a process holds only
    what is in flight: the shards its batches being made are reading (one being downloaded, or one just dropped
    while a batch still reads it). So a rank holds at most workers x `cache_bytes` + that. `cache_peak_bytes` is
    the most this process's cache has held.

    The corrupt source images `pack` left out are listed in `pack_skipped` (path, why). `skipped` and
    `bad_samples` are 0: a sample that fails to decode here (a damaged shard) raises `CorruptImageError` naming
    the shard and key.
    """

    normalize = Normalize()

    def __init__(self, root: str | Path, *, image_size: int = 64, train: bool = True, decode: str = "draft",
                 crop_scale: tuple[float, float] = (0.35, 1.0), center_fraction: float = 0.875,
                 retry_s: float | None = None, storage_options: dict[str, Any] | None = None,
                 cache_bytes: int = CACHE_BYTES) -> None:
        if cache_bytes < 0:
            raise ValueError(f"cache_bytes={cache_bytes} is not valid; give bytes >= 0 (0: no shard kept whole, "
                             f"every sample read by range; default {CACHE_BYTES})")
        self.cache_bytes = cache_bytes
        self._store: ObjectStore | None = None
        if isinstance(root, str) and is_url(root):
            self._store = ObjectStore(root, retry_s=retry_s, storage_options=storage_options)
            root = self._store.url
            index_text = self._read_index(root)
        else:
            check_scheme(str(root))
            root = Path(root)
            if not (root / INDEX_NAME).is_file():
                raise FileNotFoundError(f"{str(root)!r} has no {INDEX_NAME}; pack an image folder into it with "
                                        f"'trainfast pack SRC {root}'")
            index_text = (root / INDEX_NAME).read_text()
        index_path = join(root, INDEX_NAME)
        if decode not in ("draft", "full"):
            raise ValueError(f"decode={decode!r} is not valid; choose 'draft' or 'full'")
        if image_size < 8:
            raise ValueError(f"image_size={image_size} is too small; use 8 or more")
        index = json.loads(index_text)
        if index.get("version") != INDEX_VERSION:
            raise ValueError(f"{str(index_path)!r} has format version {index.get('version')!r}; this trainfast reads "
                             f"version {INDEX_VERSION}: pack the images again")
        if not index["key"]:
            raise FileNotFoundError(f"{str(index_path)!r} lists no images")
        self.root: DataRoot = root
        self.classes: list[str] = list(index["classes"])
        self.settings: dict[str, Any] = dict(index["settings"])
        self.pack_skipped: tuple[tuple[str, str], ...] = tuple((s["path"], s["why"]) for s in index["skipped"])
        self._keys = np.array(index["key"], dtype=np.int64)
        self._shards = np.array(index["shard"], dtype=np.int32)
        self._offsets = np.array(index["offset"], dtype=np.int64)
        self._sizes = np.array(index["size"], dtype=np.int64)
        self.targets = np.array(index["label"], dtype=np.int64)
        ends = self._offsets + self._sizes
        self._shard_ends = {int(n): int(ends[self._shards == n].max()) for n in np.unique(self._shards)}
        self.image_size, self.train, self.decode = image_size, train, decode
        self.crop_scale, self.center_fraction = crop_scale, center_fraction
        packed_at = self.settings.get("max_size")
        if isinstance(packed_at, int) and image_size > packed_at:
            log.warning("%s was packed with the shorter side at most %d px; at image_size=%d its images are upscaled "
                        "(blurrier than the originals): pack again with --image-size %d", root, packed_at, image_size,
                        image_size)
        self.bad_samples = 0
        self._maps: dict[int, mmap.mmap] = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._cache: OrderedDict[int, bytes] = OrderedDict()  # remote shards fetched whole, least recent first
        self._cached = 0  # bytes in _cache
        self.cache_peak_bytes = 0  # the most bytes _cache has held in this process
        self._fetching: dict[int, threading.Lock] = {}  # one download per shard when loader threads want it at once

    @property
    def read_groups(self) -> np.ndarray | None:
        """From a URL, each sample's shard: `make_loader` then visits the shards a few at a time (each fetched
        whole once). None for a local pack, whose samples cost the same in any order."""
        return self._shards if self._store is not None else None

    def _read_index(self, root: str) -> str:
        assert self._store is not None
        try:
            return self._store.read(INDEX_NAME).decode()
        except RemoteStorageError as e:
            if e.status == 404:  # no pack there: the same error as for a local folder
                raise FileNotFoundError(f"{root!r} has no {INDEX_NAME} ({e.url}: 404 Not Found); pack an image "
                                        f"folder into it with 'trainfast pack SRC {root}'") from e
            raise

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def shards(self) -> int:
        """How many shard files hold the samples."""
        return len(self._shard_ends)

    @property
    def sample_bytes(self) -> int:
        return image_sample_bytes(self.image_size)

    @property
    def skipped(self) -> int:
        """0: there is nothing to skip at read time (see `pack_skipped` for what `pack` left out)."""
        return 0

    def path(self, index: int) -> str:
        """`<root>/shard-NNNNNN.tar:<key>.jpg`, the sample's place (for messages)."""
        shard = SHARD_PATTERN.format(int(self._shards[index]))
        return f"{join(self.root, shard)}:{int(self._keys[index]):0{KEY_DIGITS}d}.jpg"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"], state["_cache"] = {}, OrderedDict()  # open maps stay in the process that opened them
        state["_cached"] = state["cache_peak_bytes"] = 0
        del state["_lock"], state["_fetching"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock(), _fetching={})

    def _own(self) -> None:
        """Forked after opening: our own maps and cache, and locks no parent thread holds."""
        if self._pid != os.getpid():
            self._maps, self._cache, self._fetching = {}, OrderedDict(), {}
            self._cached = self.cache_peak_bytes = 0
            self._lock, self._pid = threading.Lock(), os.getpid()

    def _map(self, shard: int) -> mmap.mmap:
        self._own()
        mm = self._maps.get(shard)
        if mm is None:
            with self._lock:  # one map per shard even when loader threads ask for it at once
                mm = self._maps.get(shard)
                if mm is None:
                    mm = self._maps[shard] = self._open(shard)
        return mm

    def _open(self, shard: int) -> mmap.mmap:
        assert isinstance(self.root, Path)
        path = self.root / SHARD_PATTERN.format(shard)
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if len(mm) < self._shard_ends[shard]:
            size = len(mm)
            mm.close()
            raise CorruptImageError(f"shard {str(path)!r} is {size} bytes, shorter than its index says "
                                    f"({self._shard_ends[shard]}); pack the images again")
        return mm

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self._store is not None:
            return self._fetch([index])[0]
        shard, offset, size = int(self._shards[index]), int(self._offsets[index]), int(self._sizes[index])
        return self._sample(index, self._map(shard)[offset:offset + size])

    @property
    def __getitems__(self) -> Callable[[list[int]], list[tuple[torch.Tensor, int]]]:
        """A batch's samples (the loaders call it when the dataset has it): from a URL, one concurrent request of
        all their byte ranges. A local pack has none (AttributeError), so the loaders read it per sample, as
        before: an mmap read costs no round-trip to save."""
        if self._store is None:
            raise AttributeError("__getitems__")
        return self._fetch

    def _fetch(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        self._own()
        shards = [int(self._shards[i]) for i in indices]
        counts = Counter(shards)
        whole = {n: self._whole(n) for n, count in counts.items() if n in self._cache or (
                 self._shard_ends[n] <= self.cache_bytes
                 and (count >= WHOLE_SHARD_SAMPLES or self._shard_ends[n] <= SMALL_SHARD_BYTES))}
        ranged = [k for k, n in enumerate(shards) if n not in whole]
        datas: list[bytes] = [b""] * len(indices)
        for k, n in enumerate(shards):
            if n in whole:
                start = int(self._offsets[indices[k]])
                datas[k] = whole[n][start:start + int(self._sizes[indices[k]])]
        if ranged:
            got = self._ranges([indices[k] for k in ranged])
            for k, data in zip(ranged, got, strict=True):
                datas[k] = data
        return [self._sample(i, data) for i, data in zip(indices, datas, strict=True)]

    def _whole(self, shard: int) -> bytes:
        """Shard `shard` fetched whole (once per process while it stays within the `cache_bytes` used last)."""
        assert self._store is not None
        with self._lock:
            if shard in self._cache:
                self._cache.move_to_end(shard)
                return self._cache[shard]
            download = self._fetching.setdefault(shard, threading.Lock())
        with download:  # another thread fetching the same shard: wait for it, then take its copy
            with self._lock:
                if shard in self._cache:
                    return self._cache[shard]
            name, end = SHARD_PATTERN.format(shard), self._shard_ends[shard]
            # one request up to its last sample's end: the tar's end padding (up to 10 KiB) is neither sent nor held,
            # so what is kept is exactly the size the index gives, which the caller checked against the bound
            data = self._store.read_ranges([name], [0], [end])[0]
            if len(data) < end:
                raise CorruptImageError(f"shard {join(self.root, name)!r} is {len(data)} bytes, shorter than its "
                                        f"index says ({end}); pack the images again")
            with self._lock:
                self._cache[shard] = data
                self._cached += len(data)
                while self._cached > self.cache_bytes:  # the least recently used first (never this one: it fits)
                    self._cached -= len(self._cache.popitem(last=False)[1])
                self.cache_peak_bytes = max(self.cache_peak_bytes, self._cached)
                self._fetching.pop(shard, None)
        return data

    def _ranges(self, indices: list[int]) -> list[bytes]:
        """The samples' bytes by range, all requested at once."""
        assert self._store is not None
        shards = [SHARD_PATTERN.format(int(self._shards[i])) for i in indices]
        starts = [int(self._offsets[i]) for i in indices]
        ends = [int(self._offsets[i] + self._sizes[i]) for i in indices]
        datas = self._store.read_ranges(shards, starts, ends)
        for i, shard, start, end, data in zip(indices, shards, starts, ends, datas, strict=True):
            if len(data) != end - start:  # a shard shorter than its index says
                raise CorruptImageError(f"{self.path(i)}: got {len(data)} of bytes {start}-{end - 1} of "
                                        f"{join(self.root, shard)}; the shard is shorter than its index says: pack "
                                        "the images again")
        return datas

    def _sample(self, index: int, data: bytes) -> tuple[torch.Tensor, int]:
        image = decode_image(io.BytesIO(data), self.path(index), image_size=self.image_size, train=self.train,
                             decode=self.decode, crop_scale=self.crop_scale, center_fraction=self.center_fraction)
        return image, int(self.targets[index])

    def close(self) -> None:
        """Close the shards this process opened and drop the remote ones it holds (they reopen on the next read)."""
        with self._lock:
            maps, self._maps = self._maps, {}
            self._cache.clear()
            self._cached = 0
        for mm in maps.values():
            mm.close()
