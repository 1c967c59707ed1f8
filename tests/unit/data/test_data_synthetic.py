"""The demo dataset: deterministic drawing, folder layout, caching, atomic creation and its default location."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from trainfast.cache import cache_root
from trainfast.data import synthetic
from trainfast.data.synthetic import CLASSES, SIZES, DemoSize, demo_dir, draw_image, ensure_demo_dataset

SMALL = DemoSize(name="t", train_per_class=2, val_per_class=1)


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("label", range(len(CLASSES)))
def test_draw_image_is_deterministic_for_the_same_seed(label: int) -> None:
    a = draw_image(label, np.random.default_rng(42))
    b = draw_image(label, np.random.default_rng(42))
    assert a.size == b.size
    assert np.array_equal(np.asarray(a), np.asarray(b))
    c = draw_image(label, np.random.default_rng(43))
    assert a.size != c.size or not np.array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.parametrize("seed", range(12))
def test_draw_image_size_is_300_to_500_px_on_the_long_side(seed: int) -> None:
    img = draw_image(seed % len(CLASSES), np.random.default_rng(seed))
    assert isinstance(img, Image.Image)
    assert img.mode == "RGB"
    long_side, short_side = max(img.size), min(img.size)
    assert 300 <= long_side <= 500
    assert short_side >= int(long_side * 0.75)


def test_draw_image_classes_differ_for_the_same_stream() -> None:
    images = [np.asarray(draw_image(label, np.random.default_rng(0))) for label in range(len(CLASSES))]
    digests = {hashlib.sha256(a.tobytes()).hexdigest() for a in images}
    assert len(digests) == len(CLASSES)


def test_ensure_demo_dataset_makes_imagefolder_layout(tmp_path: Path) -> None:
    root = ensure_demo_dataset(SMALL, root=tmp_path / "ds", processes=1)
    assert root == tmp_path / "ds"
    for split, per_class in (("train", 2), ("val", 1)):
        folders = sorted(p.name for p in (root / split).iterdir())
        assert folders == sorted(CLASSES)
        for name in CLASSES:
            files = sorted(p.name for p in (root / split / name).iterdir())
            assert files == [f"{i:05d}.jpg" for i in range(per_class)]
    with Image.open(root / "train" / "circle" / "00000.jpg") as im:
        assert im.format == "JPEG"
        assert 300 <= max(im.size) <= 500
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # no staging folder left behind


def test_generation_is_byte_identical_for_a_seed_and_differs_across_seeds(tmp_path: Path) -> None:
    a = _hashes(ensure_demo_dataset(SMALL, root=tmp_path / "a", seed=7, processes=1))
    b = _hashes(ensure_demo_dataset(SMALL, root=tmp_path / "b", seed=7, processes=1))
    c = _hashes(ensure_demo_dataset(SMALL, root=tmp_path / "c", seed=8, processes=1))
    assert len(a) == 10 * (2 + 1)
    assert a == b
    assert a.keys() == c.keys()
    assert all(a[k] != c[k] for k in a), "a different seed must give different images"


def test_existing_dataset_is_returned_without_regenerating(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = ensure_demo_dataset(SMALL, root=tmp_path / "ds", processes=1)
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    before[root] = root.stat().st_mtime_ns

    def must_not_run(job: object) -> None:
        raise AssertionError("regenerated an existing dataset")

    monkeypatch.setattr(synthetic, "_write_one", must_not_run)
    again = ensure_demo_dataset(SMALL, root=tmp_path / "ds", processes=1)
    assert again == root
    after = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    after[root] = root.stat().st_mtime_ns
    assert after == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_failed_generation_leaves_no_staging_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    error: BaseException) -> None:
    real = synthetic._write_one
    written: list[object] = []

    def fail_after_three(job: tuple[Path, str, int, int, int]) -> None:
        if len(written) == 3:
            raise error
        real(job)
        written.append(job)

    monkeypatch.setattr(synthetic, "_write_one", fail_after_three)
    parent = tmp_path / "cache"
    with pytest.raises(type(error)):
        ensure_demo_dataset(SMALL, root=parent / "ds", processes=1)
    assert len(written) == 3  # it failed part-way, with files already in the staging folder
    assert not (parent / "ds").exists()
    assert list(parent.iterdir()) == []

    monkeypatch.setattr(synthetic, "_write_one", real)  # a later run builds it completely
    root = ensure_demo_dataset(SMALL, root=parent / "ds", processes=1)
    assert len(_hashes(root)) == 30


def test_a_half_made_folder_without_val_is_not_trusted(tmp_path: Path) -> None:
    (tmp_path / "ds" / "train").mkdir(parents=True)  # e.g. left by an older, non-atomic tool
    with pytest.raises(OSError):  # the rename cannot replace a non-empty folder ...
        ensure_demo_dataset(SMALL, root=tmp_path / "ds", processes=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # ... and the staging copy is removed


@pytest.mark.parametrize("name", ["huge", "Quick", "", "tiny"])
def test_unknown_size_name_lists_valid_sizes(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match=rf"unknown demo dataset size {name!r}; valid sizes: quick, default"):
        ensure_demo_dataset(name, root=tmp_path / "ds", processes=1)
    assert not (tmp_path / "ds").exists()


def test_default_location_follows_trainfast_cache(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SIZES, "t", SMALL)
    assert cache_root() == cache_dir
    root = ensure_demo_dataset("t", seed=3, processes=1)
    assert root == demo_dir("t", seed=3)
    assert root.parent == cache_dir
    assert root.name == "demo-v1-t-seed3"
    assert len(_hashes(root)) == 30
    assert sorted(p.name for p in cache_dir.iterdir()) == [root.name]


def test_default_location_for_a_demo_size_object_uses_its_name(cache_dir: Path) -> None:
    root = ensure_demo_dataset(SMALL, processes=1)
    assert root == cache_dir / "demo-v1-t-seed0"


def test_cache_root_expands_user_and_defaults_to_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TRAINFAST_CACHE", "~/elsewhere")
    assert cache_root() == tmp_path / "elsewhere"
    monkeypatch.delenv("TRAINFAST_CACHE")
    assert cache_root() == tmp_path / ".cache" / "trainfast"
    monkeypatch.setenv("TRAINFAST_CACHE", "")
    assert cache_root() == tmp_path / ".cache" / "trainfast"


def test_write_one_is_independent_of_job_order(tmp_path: Path) -> None:
    for sub in ("x", "y"):
        (tmp_path / sub / "val" / CLASSES[4]).mkdir(parents=True)
    synthetic._write_one((tmp_path / "x", "val", 4, 2, 5))
    synthetic._write_one((tmp_path / "y", "val", 4, 1, 5))
    synthetic._write_one((tmp_path / "y", "val", 4, 2, 5))
    name = os.path.join("val", CLASSES[4], "00002.jpg")
    assert (tmp_path / "x" / name).read_bytes() == (tmp_path / "y" / name).read_bytes()
