"""Corrupt and truncated images: `ImageFolder(on_bad_sample="raise" | "skip", max_bad_fraction=...)`, alone and
through `make_loader` with workers. Each test works on a private copy of the tiny val split (10 classes x 4)
with a few files broken."""

from __future__ import annotations

import errno
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from trainfast.data.decode import CorruptImageError
from trainfast.data.images import MAX_FILES_TRIED, ImageFolder
from trainfast.loader import Loader, LoaderError, make_loader

pytestmark = pytest.mark.timeout(60)  # every test here has a hard limit; worker tests set their own

BAD = {20: "garbage", 21: "truncated", 39: "empty"}  # two in a row, and the last file (the skip wraps around)


@pytest.fixture
def broken(tmp_path: Path, tiny_images: Path) -> tuple[Path, dict[int, str]]:
    """(root, {index: path}) of a copy of the val split with the files at `BAD`'s indices broken."""
    root = tmp_path / "val"
    shutil.copytree(tiny_images / "val", root)
    paths = ImageFolder(root)
    bad = {}
    for index, kind in BAD.items():
        path = Path(paths.path(index))
        data = path.read_bytes()
        path.write_bytes({"garbage": b"this is not a JPEG \x00\xff" * 40, "truncated": data[: len(data) // 2],
                          "empty": b""}[kind])
        bad[index] = str(path)
    return root, bad




def next_good(index: int, n: int = 40) -> int:
    while index in BAD:
        index = (index + 1) % n
    return index


def skipping(root: Path, **kwargs: Any) -> ImageFolder:
    return ImageFolder(root, image_size=16, on_bad_sample="skip", **kwargs)


# ---------------------------------------------------------------------------------------------------- skip mode

@pytest.mark.timeout(60)
def test_skip_returns_the_next_good_image_and_counts_each_bad_draw(broken: tuple[Path, dict[int, str]],
                                                                  tiny_images: Path,
                                                                  trainfast_log: pytest.LogCaptureFixture) -> None:
    root, bad = broken
    ds = skipping(root, train=False, max_bad_fraction=0.2)
    intact = ImageFolder(tiny_images / "val", image_size=16, train=False)
    for epoch in range(2):
        for i in range(len(ds)):
            x, y = ds[i]
            want_x, want_y = intact[next_good(i)]
            assert torch.equal(x, want_x) and y == want_y, i
        # 20 tries 20, 21 (bad), 22; 21 tries 21, 22; 39 wraps around to 0: 4 bad draws in 44 per epoch
        assert (ds.bad_samples, ds.samples_tried) == (4 * (epoch + 1), 44 * (epoch + 1))
    assert ds.last_bad_file == bad[39]
    warnings = [r.getMessage() for r in trainfast_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3  # once per file, however often it is drawn
    for path, warning in zip(sorted(bad.values()), sorted(warnings), strict=True):
        assert warning.startswith(f"ImageFolder: skipping corrupt image {path!r}")


@pytest.mark.timeout(60)
def test_one_bad_file_drawn_early_is_tolerated(tmp_path: Path, tiny_images: Path) -> None:
    root = tmp_path / "val"
    shutil.copytree(tiny_images / "val", root)
    first = Path(ImageFolder(root).path(0))
    first.write_bytes(b"")
    ds = skipping(root)  # max_bad_fraction=0.01: judged over at least 100 samples
    assert [ds[i][0].shape for i in range(len(ds))] == [(3, 16, 16)] * 40
    assert ds.bad_samples == 1


@pytest.mark.timeout(60)
def test_too_many_bad_samples_raise_with_the_share_the_count_the_limit_and_the_file(
        broken: tuple[Path, dict[int, str]]) -> None:
    root, bad = broken
    ds = skipping(root)
    for i in range(20):
        ds[i]
    with pytest.raises(CorruptImageError) as info:
        ds[20]
    message = str(info.value)
    assert re.search(r"too many corrupt images: 2 of the 22 samples this process \(pid \d+\) tried \(9\.1%\) could "
                     r"not be decoded, more than max_bad_fraction=0\.01 \(1\.0%; the share is judged over at least "
                     r"100 samples\)", message), message
    assert f"the last bad file was {bad[21]!r}" in message and "image file is truncated" in message
    assert "raise max_bad_fraction" in message
    assert isinstance(info.value.__cause__, CorruptImageError)


@pytest.mark.timeout(60)
def test_max_bad_fraction_zero_stops_at_the_first_bad_file(broken: tuple[Path, dict[int, str]]) -> None:
    root, bad = broken
    with pytest.raises(CorruptImageError, match=re.escape("1 of the 1 samples")) as info:
        skipping(root, max_bad_fraction=0)[39]
    assert repr(bad[39]) in str(info.value)


@pytest.mark.timeout(60)
def test_all_bad_files_raise_clearly(tmp_path: Path) -> None:
    folder = tmp_path / "all" / "a"
    folder.mkdir(parents=True)
    for name in "abcde":
        (folder / f"{name}.jpg").write_bytes(b"not an image")
    with pytest.raises(CorruptImageError, match=re.escape(
            f"no decodable image found: all 5 files from index 2 ({str(folder / 'c.jpg')!r} to "
            f"{str(folder / 'b.jpg')!r}) failed to decode")) as info:
        skipping(tmp_path / "all", max_bad_fraction=1.0)[2]
    assert "cannot identify image file" in str(info.value)
    with pytest.raises(CorruptImageError, match=r"too many corrupt images: 2 of the 2 samples"):
        skipping(tmp_path / "all")[0]  # the default limit stops it sooner


@pytest.mark.timeout(60)
def test_the_search_for_a_good_file_is_bounded(tmp_path: Path, tiny_images: Path) -> None:
    folder = tmp_path / "many" / "a"
    folder.mkdir(parents=True)
    for i in range(MAX_FILES_TRIED + 20):
        (folder / f"{i:04d}.jpg").write_bytes(b"")
    shutil.copy(next((tiny_images / "val" / "circle").glob("*.jpg")), folder / "zzzz.jpg")
    ds = skipping(tmp_path / "many", max_bad_fraction=1.0)
    with pytest.raises(CorruptImageError, match=f"no decodable image found: {MAX_FILES_TRIED} files in a row "
                                                "from index 0"):
        ds[0]
    assert ds.samples_tried == ds.bad_samples == MAX_FILES_TRIED
    assert ds[len(ds) - 1][0].shape == (3, 16, 16)  # the good file, and the search from the end wraps to it


@pytest.mark.parametrize("errno_", [errno.EMFILE, errno.ENFILE, errno.ENOMEM])
def test_running_out_of_files_or_memory_is_not_a_bad_image(monkeypatch: pytest.MonkeyPatch, tiny_images: Path,
                                                           errno_: int) -> None:
    def out_of(path: str) -> None:
        raise OSError(errno_, "out of a resource")

    monkeypatch.setattr(Image, "open", out_of)  # the PIL module images.py calls
    ds = skipping(tiny_images / "val", max_bad_fraction=1.0)
    with pytest.raises(OSError) as info:
        ds[0]
    assert not isinstance(info.value, CorruptImageError) and info.value.errno == errno_
    assert ds.bad_samples == 0


# --------------------------------------------------------------------------------------------------- raise mode

@pytest.mark.timeout(60)
def test_raise_mode_names_the_file(broken: tuple[Path, dict[int, str]]) -> None:
    root, bad = broken
    ds = ImageFolder(root, image_size=16)
    assert ds.on_bad_sample == "raise"
    for index, path in bad.items():
        with pytest.raises(CorruptImageError, match=re.escape(f"cannot decode image {path!r}")):
            ds[index]
    assert ds.bad_samples == 0  # "raise" counts nothing


# -------------------------------------------------------------------------------------- through make_loader

def loader_of(dataset: ImageFolder, workers: int, **kwargs: Any) -> Loader:
    loader = make_loader(dataset, 8, workers=workers, device="cpu", seed=5, drop_last=False,
                         multiprocessing_context="fork" if workers else None, **kwargs)
    assert isinstance(loader, Loader)
    return loader


@pytest.mark.timeout(60)
def test_skip_with_two_workers_gives_the_main_process_batches(broken: tuple[Path, dict[int, str]]) -> None:
    root, _ = broken
    main = skipping(root, train=True, max_bad_fraction=1.0)
    want = list(loader_of(main, 0))
    assert main.bad_samples == 4  # the main process fetched: its own counters
    in_workers = skipping(root, train=True, max_bad_fraction=1.0)
    loader = loader_of(in_workers, 2)
    try:
        got = list(loader)
    finally:
        loader.close()
    assert len(got) == len(want) == 5
    for (x, y), (wx, wy) in zip(got, want, strict=True):
        assert x.shape == (8, 3, 16, 16) and torch.equal(x, wx) and torch.equal(y, wy)
    assert in_workers.bad_samples == 0  # the workers counted in their own copies


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_a_worker_stops_with_a_corrupt_image_error_not_a_loader_error(broken: tuple[Path, dict[int, str]],
                                                                      mode: str) -> None:
    root, bad = broken
    # "skip" with the default limit: the worker that fetches index 20 meets 20 and 21 in one go, 2 > 1% of 100
    expected = "too many corrupt images" if mode == "skip" else "cannot decode image"
    loader = loader_of(ImageFolder(root, image_size=16, on_bad_sample=mode), 2,  # type: ignore[arg-type]
                       shuffle=False)
    try:
        with pytest.raises(CorruptImageError, match=expected) as info:
            list(loader)
    finally:
        loader.close()
    assert not isinstance(info.value, LoaderError)
    assert "in DataLoader worker process" in str(info.value)
    assert any(path in str(info.value) for path in bad.values())


# ---------------------------------------------------------------------------------------------------- validation

@pytest.mark.parametrize("value", ["ignore", "Skip", None, True])
def test_invalid_on_bad_sample_lists_the_choices(tiny_images: Path, value: Any) -> None:
    with pytest.raises(ValueError, match=re.escape(f"on_bad_sample={value!r} is not valid; choose 'raise' (stop at "
                                                   "the first corrupt image) or 'skip' (log it and use the next "
                                                   "image)")):
        ImageFolder(tiny_images / "val", on_bad_sample=value)


@pytest.mark.parametrize("value", [-0.1, 1.5, "0.01", True, float("nan"), None])
def test_invalid_max_bad_fraction_says_what_is_valid(tiny_images: Path, value: Any) -> None:
    with pytest.raises(ValueError, match=re.escape(f"max_bad_fraction={value!r} is not valid; use a number from 0 "
                                                   "to 1")):
        ImageFolder(tiny_images / "val", on_bad_sample="skip", max_bad_fraction=value)
