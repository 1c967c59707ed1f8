"""`pack` and `PackedImages`: the WebDataset shard layout, the index, sizing, corrupt sources, resuming, parity with
`ImageFolder`, workers, and `trainfast pack` + `trainfast train --data DST`."""

from __future__ import annotations

import io
import json
import pickle
import random
import shutil
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from trainfast.cli import main
from trainfast.data import CorruptImageError, ImageFolder, PackedImages, pack
from trainfast.data.packing import INDEX_NAME
from trainfast.loader.make import make_loader
from trainfast.loader.tuned import dataset_fingerprint

pytestmark = pytest.mark.timeout(120)

SIZES = [(40, 30), (24, 48), (20, 20), (64, 36), (30, 30), (16, 40)]  # some above max_size=24, some not


def make_folder(root: Path, per_class: int = 12, *, corrupt: str | None = None) -> Path:
    """root/<cat|dog>/<nn>.jpg: small JPEGs of varied sizes (one PNG), optionally one truncated file."""
    rng = np.random.default_rng(0)
    for c, name in enumerate(("cat", "dog")):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            w, h = SIZES[(i + c) % len(SIZES)]
            base = rng.integers(0, 255, (h // 4 + 1, w // 4 + 1, 3), dtype=np.uint8)
            img = Image.fromarray(base).resize((w, h), Image.Resampling.BILINEAR)
            suffix = ".png" if i == 5 else ".jpg"
            img.save(root / name / f"{i:02d}{suffix}", quality=92)
    if corrupt:
        path = root / corrupt
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    return root


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return make_folder(tmp_path / "src")


def packed(folder: Path, dst: Path, **kwargs: object) -> Path:
    pack(folder, dst, **{"max_size": 24, "shard_bytes": 4000, "workers": 1, "progress": False, **kwargs})
    return dst


def test_shards_hold_jpg_cls_pairs_in_key_order(folder: Path, tmp_path: Path) -> None:
    dst = packed(folder, tmp_path / "dst")
    shards = sorted(dst.glob("shard-*.tar"))
    assert len(shards) >= 2
    assert [s.name for s in shards] == [f"shard-{n:06d}.tar" for n in range(len(shards))]
    keys = []
    for shard in shards:
        with tarfile.open(shard) as tar:
            names = tar.getnames()
            for info in tar:
                assert info.mtime == 0 and info.uid == 0
            cls = [tar.extractfile(n).read() for n in names[1::2]]  # type: ignore[union-attr]
        assert [n.split(".")[1] for n in names] == ["jpg", "cls"] * (len(names) // 2)
        assert [n.split(".")[0] for n in names[::2]] == [n.split(".")[0] for n in names[1::2]]
        assert all(c in (b"0", b"1") for c in cls)
        keys += [n.split(".")[0] for n in names[::2]]
    assert keys == sorted(keys) and len(keys) == 24 and len(set(keys)) == 24


def test_index_offsets_read_back_the_members_bytes(folder: Path, tmp_path: Path) -> None:
    dst = packed(folder, tmp_path / "dst")
    index = json.loads((dst / INDEX_NAME).read_text())
    assert index["version"] == 1 and index["classes"] == ["cat", "dog"] and index["samples"] == 24
    assert index["settings"]["max_size"] == 24 and index["skipped"] == []
    assert index["label"] == [0] * 12 + [1] * 12
    assert sum(s["samples"] for s in index["shards"]) == 24
    for key, shard, offset, size, label in zip(index["key"], index["shard"], index["offset"], index["size"],
                                               index["label"], strict=True):
        path = dst / f"shard-{shard:06d}.tar"
        with tarfile.open(path) as tar:
            member = tar.getmember(f"{key:09d}.jpg")
            data = tar.extractfile(member).read()  # type: ignore[union-attr]
            assert tar.extractfile(f"{key:09d}.cls").read() == str(label).encode()  # type: ignore[union-attr]
        assert (member.offset_data, member.size) == (offset, size)
        with open(path, "rb") as f:
            f.seek(offset)
            assert f.read(size) == data


def test_max_size_is_respected_without_upscaling(folder: Path, tmp_path: Path) -> None:
    dst = packed(folder, tmp_path / "dst")
    index = json.loads((dst / INDEX_NAME).read_text())
    sources = sorted(p for p in folder.rglob("*") if p.is_file())
    for key, shard, offset, size in zip(index["key"], index["shard"], index["offset"], index["size"], strict=True):
        with open(dst / f"shard-{shard:06d}.tar", "rb") as f:
            f.seek(offset)
            im = Image.open(io.BytesIO(f.read(size)))
        with Image.open(sources[key]) as original:
            w, h = original.size
        assert im.format == "JPEG" and im.mode == "RGB"
        assert min(im.size) == min(min(w, h), 24)  # shrunk to 24, or left as it was: never upscaled
        assert abs(im.size[0] / im.size[1] - w / h) < 0.1


def test_default_max_size_follows_image_size(folder: Path, tmp_path: Path) -> None:
    pack(folder, tmp_path / "dst", image_size=16, workers=1, progress=False)
    assert json.loads((tmp_path / "dst" / INDEX_NAME).read_text())["settings"]["max_size"] == 18


def test_training_above_the_packed_size_warns(folder: Path, tmp_path: Path,
                                              trainfast_log: pytest.LogCaptureFixture) -> None:
    dst = packed(folder, tmp_path / "dst")  # shorter side at most 24 px
    PackedImages(dst, image_size=24)
    assert "upscaled" not in trainfast_log.text
    PackedImages(dst, image_size=32)
    assert "at most 24 px" in trainfast_log.text and "--image-size 32" in trainfast_log.text


def test_a_corrupt_source_image_is_skipped_and_counted(tmp_path: Path) -> None:
    src = make_folder(tmp_path / "src", corrupt="dog/03.jpg")
    result = pack(src, tmp_path / "dst", max_size=24, shard_bytes=4000, workers=1, progress=False)
    assert result.samples == 23 and len(result.skipped) == 1
    assert result.skipped[0][0] == str(src / "dog" / "03.jpg") and "truncated" in result.skipped[0][1].lower()
    index = json.loads((tmp_path / "dst" / INDEX_NAME).read_text())
    assert index["samples"] == 23 and index["source_files"] == 24
    assert [s["path"] for s in index["skipped"]] == [str(src / "dog" / "03.jpg")]
    assert 15 not in index["key"]  # the corrupt file's key is a gap
    assert PackedImages(tmp_path / "dst").pack_skipped == result.skipped


def test_a_rerun_keeps_finished_shards_and_rewrites_a_missing_one_identically(folder: Path, tmp_path: Path) -> None:
    dst = packed(folder, tmp_path / "dst")
    shards = sorted(dst.glob("shard-*.tar"))
    before = {s.name: (s.stat().st_ino, s.stat().st_mtime_ns, s.read_bytes()) for s in shards}
    index_before = (dst / INDEX_NAME).read_text()
    victim = shards[1]
    victim.unlink()
    result = pack(folder, dst, max_size=24, shard_bytes=4000, workers=1, progress=False)
    assert result.shards_written == 1 and result.shards_kept == len(shards) - 1
    for s in shards:
        ino, mtime, data = before[s.name]
        assert s.read_bytes() == data
        if s != victim:
            assert (s.stat().st_ino, s.stat().st_mtime_ns) == (ino, mtime)
    assert (dst / INDEX_NAME).read_text() == index_before
    with pytest.raises(FileExistsError, match="other settings"):
        pack(folder, dst, max_size=20, shard_bytes=4000, workers=1, progress=False)


def test_another_source_with_the_same_file_names_is_not_taken_for_this_one(folder: Path, tmp_path: Path) -> None:
    dst = packed(folder, tmp_path / "dst")
    other = make_folder(tmp_path / "other")
    path = other / "cat" / "00.jpg"
    Image.open(path).convert("RGB").resize((48, 40)).save(path, quality=70)  # same name, other content and size
    with pytest.raises(FileExistsError, match="another file list"):
        pack(other, dst, max_size=24, shard_bytes=4000, workers=1, progress=False)


def test_a_root_with_train_and_val_packs_both_splits(tmp_path: Path) -> None:
    make_folder(tmp_path / "src" / "train", per_class=6)
    make_folder(tmp_path / "src" / "val", per_class=3)
    result = pack(tmp_path / "src", tmp_path / "dst", max_size=24, workers=2, shard_bytes=3000, progress=False)
    assert set(result.splits) == {"train", "val"} and result.samples == 18
    assert len(PackedImages(tmp_path / "dst" / "train")) == 12 and len(PackedImages(tmp_path / "dst" / "val")) == 6


def _reencoded_folder(dst: Path, root: Path) -> Path:
    """The pack's own JPEG bytes written out as root/<class>/<key>.jpg: what ImageFolder reads to compare."""
    index = json.loads((dst / INDEX_NAME).read_text())
    for key, shard, offset, size, label in zip(index["key"], index["shard"], index["offset"], index["size"],
                                               index["label"], strict=True):
        with open(dst / f"shard-{shard:06d}.tar", "rb") as f:
            f.seek(offset)
            data = f.read(size)
        (root / index["classes"][label]).mkdir(parents=True, exist_ok=True)
        (root / index["classes"][label] / f"{key:09d}.jpg").write_bytes(data)
    return root


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_samples_equal_image_folder_on_the_packs_own_jpegs(folder: Path, tmp_path: Path, train: bool) -> None:
    dst = packed(folder, tmp_path / "dst")
    reference = ImageFolder(_reencoded_folder(dst, tmp_path / "ref"), image_size=16, train=train)
    ds = PackedImages(dst, image_size=16, train=train)
    assert len(ds) == len(reference) and ds.classes == reference.classes and ds.sample_bytes == reference.sample_bytes
    assert ds.normalize == reference.normalize and ds.skipped == 0
    state = random.getstate()
    try:
        for i in range(len(ds)):
            random.seed(i)
            x, y = ds[i]
            random.seed(i)
            rx, ry = reference[i]
            assert x.dtype == torch.uint8 and x.shape == (3, 16, 16) and (x.shape, x.dtype) == (rx.shape, rx.dtype)
            assert y == ry and torch.equal(x, rx)  # the same bytes, the same decode: exactly equal
    finally:
        random.setstate(state)


def test_samples_match_image_folder_on_the_originals_within_tolerance(folder: Path, tmp_path: Path) -> None:
    """Nothing is shrunk at max_size=64: the JPEG sources are stored byte for byte (equal samples), the PNGs are
    re-encoded as JPEG (close: quality 90 with 4:2:0 chroma on colour noise, the worst case for JPEG)."""
    dst = packed(folder, tmp_path / "dst", max_size=64)
    ds, reference = PackedImages(dst, image_size=16, train=False), ImageFolder(folder, image_size=16, train=False)
    pngs = 0
    for i in range(len(ds)):
        x, y = ds[i]
        rx, ry = reference[i]
        assert y == ry and x.shape == rx.shape and x.dtype == rx.dtype
        if reference.path(i).endswith(".png"):
            pngs += 1
            assert (x.int() - rx.int()).abs().float().mean() < 16
        else:
            assert torch.equal(x, rx)
    assert pngs == 2


def test_pickles_without_open_maps_and_feeds_a_worker(folder: Path, tmp_path: Path) -> None:
    ds = PackedImages(packed(folder, tmp_path / "dst"), image_size=16)
    ds[0]
    assert ds._maps
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._maps == {} and clone[0][0].shape == (3, 16, 16)
    loader = make_loader(ds, 8, workers=1, device="cpu")
    batches = list(loader)
    assert len(batches) == 3
    x, y = batches[0]
    assert x.shape == (8, 3, 16, 16) and x.dtype == torch.uint8 and y.shape == (8,)


def test_loader_threads_map_each_shard_once(folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = PackedImages(packed(folder, tmp_path / "dst"), image_size=16)
    opened: list[int] = []
    real_open = PackedImages._open

    def slow_open(self: PackedImages, shard: int) -> Any:
        opened.append(shard)
        time.sleep(0.05)  # wide enough a window that unlocked readers would all open the shard
        return real_open(self, shard)
    monkeypatch.setattr(PackedImages, "_open", slow_open)
    start = threading.Barrier(4)

    def read() -> None:
        start.wait()
        ds[0]
    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert opened == [0] and ds.shards > 1
    ds.close()
    assert ds._maps == {} and ds[0][0].shape == (3, 16, 16)


def test_a_repack_with_other_settings_is_another_dataset_to_the_tuning_cache(folder: Path, tmp_path: Path) -> None:
    first = dataset_fingerprint(PackedImages(packed(folder, tmp_path / "dst"), image_size=16))
    again = dataset_fingerprint(PackedImages(packed(folder, tmp_path / "dst"), image_size=16))
    shutil.rmtree(tmp_path / "dst")  # the same folder, the same images, packed smaller
    repacked = dataset_fingerprint(PackedImages(packed(folder, tmp_path / "dst", max_size=20), image_size=16))
    assert first == again != repacked


def test_a_truncated_shard_is_named(folder: Path, tmp_path: Path) -> None:
    dst = packed(folder, tmp_path / "dst")
    shard = dst / "shard-000000.tar"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CorruptImageError, match=r"shard-000000\.tar.*shorter than its index"):
        PackedImages(dst)[0]


def test_cli_pack_then_train_on_the_pack(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_folder(tmp_path / "src" / "train", per_class=8)
    make_folder(tmp_path / "src" / "val", per_class=4)
    dst = tmp_path / "packed"
    assert main(["pack", str(tmp_path / "src"), str(dst), "--image-size", "16", "--shard-bytes", "3000",
                 "--workers", "1"]) == 0
    assert "16 images" in capsys.readouterr().out
    assert (dst / "train" / INDEX_NAME).is_file() and (dst / "val" / INDEX_NAME).is_file()
    assert main(["train", "--data", str(dst), "--epochs", "1", "--batch-size", "8", "--image-size", "16",
                 "--device", "cpu", "--precision", "32-true", "--workers", "0"]) == 0


def test_cli_pack_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pack", str(tmp_path / "missing"), str(tmp_path / "dst")]) == 2
    assert "trainfast pack: error:" in capsys.readouterr().err
    make_folder(tmp_path / "src", per_class=2)
    assert main(["pack", str(tmp_path / "src"), str(tmp_path / "dst"), "--quality", "0"]) == 2
    assert "quality" in capsys.readouterr().err
