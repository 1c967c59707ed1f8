"""Packed data over HTTP and S3: `PackedImages(URL)`, `trainfast pack SRC s3://...` and `trainfast train --data URL`
against real servers on localhost (tests/remote_servers.py: a static HTTP server with Range requests, moto's
S3-compatible server), with injected failures: retried when transient, one line naming the request when not,
and a training run that loses its storage mid-epoch stops with its checkpoint intact and resumes bit-exactly."""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from remote_servers import RemoteServer
from trainfast.cli import EXPECTED, FAILED, error_message, main
from trainfast.data import PackedImages
from trainfast.data.packing import INDEX_NAME, PackResult, pack, upload_pack
from trainfast.data.remote import ObjectStore, RemoteStorageError, RemoteSupportMissing
from trainfast.loader.make import make_loader
from trainfast.loader.seeding import seed_all
from trainfast.trainer.checkpoint import load_checkpoint
from trainfast.trainer.config import TrainConfig
from trainfast.trainer.loop import Trainer

pytestmark = pytest.mark.timeout(120)
IMAGE_SIZE = 16
# the shard cache of a loader process in `_run`: 4 of tiny_pack's 20 KiB shards, fewer than an epoch reads, so every
# epoch reads the storage (the default cache would hold the whole tiny pack after the first)
RUN_CACHE_BYTES = 4 * 20_480


@pytest.fixture(scope="module")
def tiny_pack(tiny_images: Path, _http_server_process: RemoteServer) -> tuple[Path, PackResult]:
    """The tiny demo dataset packed at 16 px into several shards, in the HTTP server's folder (served at /tiny)."""
    assert _http_server_process.root is not None
    dst = _http_server_process.root / "tiny"
    return dst, pack(tiny_images, dst, image_size=IMAGE_SIZE, shard_bytes=12_000, workers=1, progress=False)


@pytest.fixture
def s3_tiny(tiny_pack: tuple[Path, PackResult], s3_server: RemoteServer) -> str:
    """`tiny_pack` uploaded to s3://tiny/packed (once per module: the server keeps it)."""
    url = "s3://tiny/packed"
    if not ObjectStore(url).exists(f"train/{INDEX_NAME}"):
        s3_server.make_bucket("tiny")
        upload_pack(tiny_pack[0], ObjectStore(url, writable=True), tiny_pack[1], progress=False)
    return url


def samples(dataset: PackedImages, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
    return dataset.__getitems__(indices) if hasattr(dataset, "__getitems__") else [dataset[i] for i in indices]


def test_local_http_and_s3_give_bit_identical_samples(tiny_pack: tuple[Path, PackResult], http_server: RemoteServer,
                                                      s3_tiny: str) -> None:
    local = PackedImages(tiny_pack[0] / "val", image_size=IMAGE_SIZE, train=False)
    http = PackedImages(f"{http_server.url}/tiny/val", image_size=IMAGE_SIZE, train=False)
    s3 = PackedImages(f"{s3_tiny}/val", image_size=IMAGE_SIZE, train=False)
    assert not hasattr(local, "__getitems__")  # local reads stay per sample, by mmap
    assert local.shards > 1 and len(local) == len(http) == len(s3) == 40
    indices = list(range(len(local)))
    want = samples(local, indices)
    for remote in (http, s3):
        got = samples(remote, indices)
        assert [t for _, t in got] == [t for _, t in want]
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(got, want, strict=True))
        image, target = remote[7]  # one sample alone
        assert torch.equal(image, want[7][0]) and target == want[7][1]
    assert http.path(3).startswith(f"{http_server.url}/tiny/val/shard-")


@pytest.mark.parametrize("kind", ["http", "s3"])
def test_a_503_is_retried_with_one_warning_then_the_batch_arrives(
        kind: str, tiny_pack: tuple[Path, PackResult], http_server: RemoteServer, s3_server: RemoteServer,
        s3_tiny: str, trainfast_log: pytest.LogCaptureFixture) -> None:
    server, url = (http_server, f"{http_server.url}/tiny") if kind == "http" else (s3_server, s3_tiny)
    dataset = PackedImages(f"{url}/train", image_size=IMAGE_SIZE, train=False)
    server.command("fail 503 3 shard-")
    got = dataset.__getitems__([0, 1, 2, 3, 40])
    want = PackedImages(tiny_pack[0] / "train", image_size=IMAGE_SIZE, train=False)
    assert all(torch.equal(a, want[i][0]) for (a, _), i in zip(got, [0, 1, 2, 3, 40], strict=True))
    warnings = [r.getMessage() for r in trainfast_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "503 Service Unavailable; retrying for up to 2 s" in warnings[0], warnings
    assert "shard-" in warnings[0]


@pytest.mark.parametrize("kind", ["http", "s3"])
def test_a_missing_object_is_one_line_naming_the_url_and_404_without_retries(
        kind: str, http_server: RemoteServer, s3_server: RemoteServer, s3_tiny: str) -> None:
    url = f"{http_server.url}/tiny" if kind == "http" else s3_tiny
    dataset = PackedImages(f"{url}/train", image_size=IMAGE_SIZE, train=False)
    server = http_server if kind == "http" else s3_server
    server.command("fail 404 1 shard-000001")
    started = time.monotonic()
    with pytest.raises(RemoteStorageError) as error:
        dataset.__getitems__([i for i in range(len(dataset)) if dataset._shards[i] == 1][:2])
    assert time.monotonic() - started < 1.0  # not retried
    message = str(error.value)
    assert "\n" not in message and error.value.status == 404
    assert message.startswith(f"GET {url}/train/shard-000001.tar") and ": 404 Not Found; " in message  # whole
    with pytest.raises(FileNotFoundError, match=r"has no index.json .*404 Not Found.*trainfast pack SRC"):
        PackedImages(f"{url}/nowhere")


@pytest.mark.slow
def test_a_server_that_stays_down_is_one_line_after_the_retry_budget(tiny_pack: tuple[Path, PackResult],
                                                                     http_server: RemoteServer) -> None:
    dataset = PackedImages(f"{http_server.url}/tiny/train", image_size=IMAGE_SIZE, retry_s=1.0)
    http_server.command("down")
    started = time.monotonic()
    with pytest.raises(RemoteStorageError) as error:
        dataset.__getitems__([0, 1])
    assert 0.5 < time.monotonic() - started < 3
    message = str(error.value)
    assert "\n" not in message and error.value.status is None
    assert message.startswith(f"GET {http_server.url}/tiny/train/shard-000000.tar"), message
    assert " tries over " in message and "TRAINFAST_REMOTE_RETRY_S" in message and "refused" in message.lower()


def test_a_url_without_the_remote_extra_names_the_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs now raises ImportError
    with pytest.raises(RemoteSupportMissing, match=r"needs the s3fs package .*pip install 'trainfast\[remote\]'"):
        PackedImages("s3://bucket/data/train")


def test_pack_refuses_to_write_over_http(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pack", str(tmp_path), "http://example.invalid/data"]) == 2
    err = capsys.readouterr().err
    assert "'http://example.invalid/data' is read-only here" in err and "s3://bucket/prefix" in err


@pytest.mark.slow
def test_pack_to_s3_then_train_from_it(tmp_path: Path, s3_server: RemoteServer,
                                       capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers import make_images

    monkeypatch.setenv("TRAINFAST_CACHE", str(tmp_path / "cache"))  # the staging folder
    src = make_images(tmp_path / "src", train=8, val=4)
    s3_server.make_bucket("packs")
    argv = ["pack", str(src), "s3://packs/small", "--image-size", "16", "--shard-bytes", "3000", "--workers", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "at s3://packs/small/train (train)" in out and "already there" in out
    assert not any((tmp_path / "cache" / "pack-staging").iterdir())  # removed once uploaded
    store = ObjectStore("s3://packs/small")
    assert store.exists("train/index.json") and store.exists("val/index.json")
    assert main(argv) == 0  # a rerun uploads no shard again
    assert "; 0 uploaded, 16 already there" in capsys.readouterr().out
    assert main(["train", "--data", "s3://packs/small", "--epochs", "1", "--image-size", "16", "--batch-size", "4",
                 "--limit-batches", "2", "--device", "cpu", "--precision", "32-true", "--no-progress",
                 "--workers", "1"]) == 0
    assert "trained 1 epoch(s), 2 steps" in capsys.readouterr().out


def test_the_cli_says_a_storage_error_in_one_line_naming_the_intact_checkpoint(tmp_path: Path) -> None:
    line = "GET s3://b/p/train/shard-000000.tar bytes 0-9: connection refused after 6 tries over 31 s; is the server up"
    wrapped = RemoteStorageError("Caught RemoteStorageError in DataLoader worker process 0.\nOriginal Traceback (most "
                                 "recent call last):\n  File \"x.py\", line 1, in f\n"
                                 f"trainfast.data.remote.RemoteStorageError: {line}\n")  # as torch re-raises it
    assert dict(EXPECTED)[RemoteStorageError] == FAILED
    assert error_message(wrapped, argparse.Namespace(checkpoint_dir=str(tmp_path))) == \
        f"{line}. No checkpoint was written yet"
    (tmp_path / "last.pt").write_bytes(b"saved")
    assert error_message(RemoteStorageError(line), argparse.Namespace(checkpoint_dir=str(tmp_path))) == \
        f"{line}. {tmp_path / 'last.pt'} is intact: once the storage answers, rerun the same command with --resume"


def _run(url: str, ckpt: Path | None, *, resume: bool = False, callbacks: tuple[object, ...] = ()) -> Trainer:
    """2 epochs of 10 batches over the pack at `url`, in a loader worker process (it makes its own client)."""
    seed_all(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * IMAGE_SIZE * IMAGE_SIZE, 32), nn.GELU(), nn.Linear(32, 10))
    loader = make_loader(PackedImages(f"{url}/train", image_size=IMAGE_SIZE, cache_bytes=RUN_CACHE_BYTES), 8,
                         workers=1, seed=3)
    config = TrainConfig(epochs=2, progress=False, warmup_steps=2, device="cpu", precision="32-true", log_every=1,
                         checkpoint_dir=str(ckpt) if ckpt else None)
    trainer = Trainer(model, config=config, callbacks=callbacks)
    trainer.fit(loader, resume=resume)
    return trainer


class StopServerAt:
    """Takes the server down at optimizer step `step` (the Trainer calls on_log there: log_every=1)."""

    def __init__(self, server: RemoteServer, step: int) -> None:
        self.server, self.step = server, step

    def on_log(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if metrics["step"] == self.step:
            self.server.command("down")


@pytest.mark.slow
def test_storage_lost_mid_epoch_stops_with_the_checkpoint_intact_and_resume_is_bit_exact(
        tmp_path: Path, s3_server: RemoteServer, s3_tiny: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINFAST_REMOTE_RETRY_S", "0.6")  # gives up after 3 tries
    reference = _run(s3_tiny, None)
    with pytest.raises(RemoteStorageError) as error:
        _run(s3_tiny, tmp_path, callbacks=(StopServerAt(s3_server, 13),))  # mid second epoch
    line = error_message(error.value, argparse.Namespace())  # as `trainfast train` says it: from the worker's error
    assert "\n" not in line and line.startswith(f"GET {s3_tiny}/train/shard-") and " tries over " in line, line
    saved = load_checkpoint(tmp_path / "last.pt")
    assert (saved["epoch"], saved["step"]) == (1, 10)  # the end of the first epoch, intact
    digest = hashlib.sha256((tmp_path / "last.pt").read_bytes()).hexdigest()
    s3_server.command("up")
    resumed = _run(s3_tiny, tmp_path, resume=True)
    assert resumed.step == reference.step == 20
    for key, value in reference.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[key]), key
    assert digest != hashlib.sha256((tmp_path / "last.pt").read_bytes()).hexdigest()  # the resumed run saved anew


def test_an_epoch_from_a_url_fetches_each_shard_whole_once(tiny_pack: tuple[Path, PackResult],
                                                           http_server: RemoteServer) -> None:
    """make_loader visits remote shards a window at a time, so each is one request an epoch, not one per sample."""
    sizes = [p.stat().st_size for p in (tiny_pack[0] / "train").glob("shard-*.tar")]
    cache_bytes = 4 * max(sizes)  # 4 shards, as many as two windows hold
    dataset = PackedImages(f"{http_server.url}/tiny/train", image_size=IMAGE_SIZE, train=False, cache_bytes=cache_bytes)
    assert dataset.read_groups is not None and sum(sizes) > 2 * cache_bytes  # more shards than the cache holds
    loader = make_loader(dataset, 8, workers=0, seed=3)
    before = http_server.requests()
    seen = [int(t) for _, targets in loader for t in targets]
    assert len(seen) == len(loader) * 8
    assert http_server.requests() - before == dataset.shards  # one whole-shard GET each
    local = PackedImages(tiny_pack[0] / "train", image_size=IMAGE_SIZE, train=False)
    assert local.read_groups is None  # a local pack keeps the plain shuffle
