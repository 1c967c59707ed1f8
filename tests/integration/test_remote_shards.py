"""A remote pack under 2 ranks (each rank's loader run in turn in this process, as `rank=r, world_size=2`), served by
moto's S3-compatible server (tests/remote_servers.py), which counts the bytes it sends: each rank fetches about half
the pack an epoch, not all of it, every sample is seen once across the ranks, and with 4 worker processes per rank
each worker's shard cache stays within its byte bound."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from helpers import make_images
from remote_servers import RemoteServer
from trainfast.data import PackedImages
from trainfast.data.packing import INDEX_NAME, PackResult, pack, upload_pack
from trainfast.data.remote import ObjectStore
from trainfast.loader.make import Loader, make_loader

pytestmark = pytest.mark.timeout(120)
URL = "s3://shards/packed"
BATCH = 6  # 27 batches a rank: runs of 42 or 34 samples, which split 4-sample shards at their ends
MOST_PER_RANK = 0.6  # of the pack's bytes, per rank and epoch with 2 ranks (before the split: every rank read it all)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PackResult]:
    """320 small JPEGs packed at 16 px, 4 to a shard: 80 shards, so a rank's or worker's run holds many."""
    root = tmp_path_factory.mktemp("shards")
    src = make_images(root / "src", train=160, val=0, size=(20, 16))
    result = pack(src, root / "packed", image_size=16, shard_bytes=9_000, workers=1, progress=False)
    return root / "packed" / "train", result


@pytest.fixture
def s3_pack(packed: tuple[Path, PackResult], s3_server: RemoteServer) -> tuple[str, int]:
    """The pack uploaded to moto (once per module); its URL and the bytes reading it all once takes: each shard up to
    its last sample's end (a shard is fetched that far; the tar's end padding, a large part of such tiny shards, is
    not read, so counting it would flatter the figure)."""
    if not ObjectStore(URL).exists(f"train/{INDEX_NAME}"):
        s3_server.make_bucket("shards")
        upload_pack(packed[0].parent, ObjectStore(URL, writable=True), packed[1], progress=False)
    index = json.loads((packed[0] / INDEX_NAME).read_text())
    ends: dict[int, int] = {}
    for shard, offset, size in zip(index["shard"], index["offset"], index["size"], strict=True):
        ends[shard] = max(ends.get(shard, 0), offset + size)
    return f"{URL}/train", sum(ends.values())


class Recorded(PackedImages):
    """PackedImages that returns each sample's index with it and appends, per batch, the indices and the most
    bytes its shard cache has held in this process to `out/<pid>.jsonl` (loader workers are other processes)."""

    out: Path

    def _fetch(self, indices: list[int]) -> list[Any]:
        got = super()._fetch(indices)
        with open(self.out / f"{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps({"indices": indices, "peak": self.cache_peak_bytes}) + "\n")
        return [(image, target, i) for (image, target), i in zip(got, indices, strict=True)]


def recorded(url: str, out: Path, **kwargs: Any) -> Recorded:
    out.mkdir()
    dataset = Recorded(url, image_size=16, train=False, **kwargs)
    dataset.out = out
    return dataset


def per_process(out: Path) -> dict[str, list[dict[str, Any]]]:
    return {p.stem: [json.loads(line) for line in p.read_text().splitlines()] for p in out.glob("*.jsonl")}


def test_two_ranks_each_fetch_about_half_the_pack_and_see_every_sample_once(
        s3_pack: tuple[str, int], s3_server: RemoteServer, tmp_path: Path) -> None:
    url, pack_bytes = s3_pack
    seen: list[int] = []
    for rank in range(2):
        dataset = recorded(url, tmp_path / str(rank))
        loader = make_loader(dataset, BATCH, workers=0, rank=rank, world_size=2, seed=5, drop_last=False,
                             device="cpu")
        assert dataset.shards == 80 and len(dataset) == 320
        s3_server.command("reset")  # the index read by the constructor is not the epoch's
        for _, _, indices in loader:
            seen += indices.tolist()
        fetched = s3_server.bytes_sent()
        assert fetched <= MOST_PER_RANK * pack_bytes, (rank, fetched / pack_bytes)
    assert sorted(seen) == list(range(320))  # every sample once (160 a rank: no padding)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 4 workers on a 2-core machine
def test_four_workers_a_rank_keep_the_bytes_and_each_cache_within_bounds(
        s3_pack: tuple[str, int], s3_server: RemoteServer, tmp_path: Path) -> None:
    """The DataLoader is made over the loader's own sampler and fetcher (and torch's round-robin dealing to its
    workers), without `Loader`'s stream, which would go on into the next epoch's batches, whose bytes the server
    would count in this one's."""
    url, pack_bytes = s3_pack
    bound = 4 * pack_bytes // 80  # 4 shards' worth (two windows of 2); a worker's run holds ~10: the bound binds
    seen: list[int] = []
    for rank in range(2):
        dataset = recorded(url, tmp_path / str(rank), cache_bytes=bound)
        loader = make_loader(dataset, BATCH, workers=4, backend="processes", rank=rank, world_size=2, seed=5,
                             drop_last=False, device="cpu")
        assert isinstance(loader, Loader) and loader.batches.workers == 4
        made = loader.dataloader
        dataloader = DataLoader(made.dataset, batch_size=None, sampler=loader.batches, num_workers=4,
                                collate_fn=made.collate_fn, worker_init_fn=made.worker_init_fn)
        s3_server.command("reset")
        for _, _, indices in dataloader:
            seen += indices.tolist()
        fetched = s3_server.bytes_sent()
        assert fetched <= MOST_PER_RANK * pack_bytes, (rank, fetched / pack_bytes)
        workers = per_process(tmp_path / str(rank))
        assert len(workers) == 4 and str(os.getpid()) not in workers  # 4 worker processes made the batches
        peaks = [max(r["peak"] for r in records) for records in workers.values()]
        assert all(0 < peak <= bound for peak in peaks), (peaks, bound)
        assert fetched > 4 * bound  # more than 4 caches' worth went through them: the bound was used
    assert sorted(seen) == list(range(320))
