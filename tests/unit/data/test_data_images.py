"""`ImageFolder`: sample format, file list, draft decoding, augmentation determinism and error messages."""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, JpegImagePlugin

from trainfast.data.decode import CorruptImageError
from trainfast.data.images import ImageFolder
from trainfast.data.synthetic import CLASSES


@pytest.fixture
def draft_spy(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, tuple[int, int]]]:
    """Record every JPEG `draft()` call: the stored size, the requested size and the size after drafting."""
    calls: list[dict[str, tuple[int, int]]] = []
    original = JpegImagePlugin.JpegImageFile.draft

    def spy(self: JpegImagePlugin.JpegImageFile, mode: str | None, size: tuple[int, int] | None) -> object:
        before = self.size
        result = original(self, mode, size)
        calls.append({"original": before, "requested": tuple(size), "drafted": self.size})  # type: ignore[arg-type]
        return result

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    return calls


def _one_class_folder(tmp_path: Path, tiny_images: Path, n: int = 2) -> Path:
    """A private copy of a few real JPEGs under `tmp_path/root/a/`, safe to add broken files to."""
    folder = tmp_path / "root" / "a"
    folder.mkdir(parents=True)
    for src in sorted((tiny_images / "train" / "circle").glob("*.jpg"))[:n]:
        shutil.copy(src, folder / src.name)
    return folder.parent


@pytest.mark.parametrize("train", [True, False], ids=["train", "val"])
@pytest.mark.parametrize("decode", ["draft", "full"])
@pytest.mark.parametrize("image_size", [8, 32, 48])
def test_samples_are_uint8_chw_at_image_size_with_int_labels(tiny_images: Path, train: bool, decode: str,
                                                             image_size: int) -> None:
    split = "train" if train else "val"
    ds = ImageFolder(tiny_images / split, image_size=image_size, train=train, decode=decode)
    assert len(ds) == (80 if train else 40)
    for index in (0, len(ds) // 2, len(ds) - 1):
        x, y = ds[index]
        assert isinstance(x, torch.Tensor)
        assert x.dtype == torch.uint8
        assert x.shape == (3, image_size, image_size)
        assert type(y) is int
        assert ds.classes[y] == Path(ds.path(index)).parent.name


def test_classes_are_sorted_and_labels_follow_folders(tiny_images: Path) -> None:
    ds = ImageFolder(tiny_images / "train", image_size=16)
    assert ds.classes == sorted(CLASSES)
    assert ds.targets.tolist() == [label for label in range(10) for _ in range(8)]
    for index in range(len(ds)):
        assert Path(ds.path(index)).parent.name == ds.classes[int(ds.targets[index])]


def test_file_list_is_one_numpy_bytes_array_and_path_returns_str(tiny_images: Path) -> None:
    ds = ImageFolder(tiny_images / "val", image_size=16, train=False)
    assert isinstance(ds._paths, np.ndarray)
    assert ds._paths.dtype.kind == "S"
    assert ds._paths.shape == (40,)
    for index in (0, 39):
        p = ds.path(index)
        assert type(p) is str
        assert Path(p).is_file()
        assert p.endswith(".jpg")
    assert [ds.path(i) for i in range(len(ds))] == sorted(
        str(p) for p in (tiny_images / "val").glob("*/*.jpg"))


def test_file_list_keeps_non_ascii_paths(tmp_path: Path, tiny_images: Path) -> None:
    folder = tmp_path / "données" / "chat-é"
    folder.mkdir(parents=True)
    src = next((tiny_images / "train" / "circle").glob("*.jpg"))
    shutil.copy(src, folder / "ímage.jpg")
    ds = ImageFolder(folder.parent, image_size=16)
    assert ds.path(0) == str(folder / "ímage.jpg")
    assert ds[0][0].shape == (3, 16, 16)


@pytest.mark.parametrize("image_size", [32, 64, 96])
def test_draft_and_full_decode_give_nearly_the_same_val_image(tiny_images: Path, image_size: int) -> None:
    draft = ImageFolder(tiny_images / "val", image_size=image_size, train=False, decode="draft")
    full = ImageFolder(tiny_images / "val", image_size=image_size, train=False, decode="full")
    diffs = []
    for index in range(0, len(draft), 3):
        a, b = draft[index][0].float(), full[index][0].float()
        diffs.append((a - b).abs().mean().item())
    assert max(diffs) < 12, f"draft decode differs from full decode by up to {max(diffs):.1f}/255"
    assert sum(diffs) / len(diffs) < 6


@pytest.mark.parametrize("train", [True, False], ids=["train", "val"])
def test_draft_decode_shrinks_the_image_but_keeps_the_crop_at_least_image_size(
        tiny_images: Path, draft_spy: list[dict[str, tuple[int, int]]], saved_rngs: None, train: bool) -> None:
    size = 32
    ds = ImageFolder(tiny_images / ("train" if train else "val"), image_size=size, train=train, decode="draft")
    random.seed(0)
    n = 12
    for index in range(n):
        ds[index]
    assert len(draft_spy) == n
    for call in draft_spy:
        (w, h), (rw, rh), (dw, dh) = call["original"], call["requested"], call["drafted"]
        assert rw < w and rh < h, call
        assert dw < w and dh < h, f"draft() did not reduce the decoded size: {call}"
        assert dw >= rw and dh >= rh, call
    if not train:  # the centre crop (short side * 0.875) must still hold image_size pixels after drafting
        for call in draft_spy:
            assert min(call["drafted"]) * ds.center_fraction >= size - 1, call


def test_full_decode_never_drafts(tiny_images: Path, draft_spy: list[dict[str, tuple[int, int]]]) -> None:
    ds = ImageFolder(tiny_images / "val", image_size=32, train=False, decode="full")
    for index in range(5):
        ds[index]
    assert draft_spy == []


def test_val_transform_is_deterministic_without_seeding(tiny_images: Path) -> None:
    ds = ImageFolder(tiny_images / "val", image_size=32, train=False)
    first = ds[7][0]
    random.random()
    assert torch.equal(ds[7][0], first)


@pytest.mark.parametrize("decode", ["draft", "full"])
def test_training_augmentation_is_deterministic_under_random_seed(tiny_images: Path, saved_rngs: None,
                                                                  decode: str) -> None:
    ds = ImageFolder(tiny_images / "train", image_size=32, train=True, decode=decode)
    random.seed(1234)
    first = [ds[i][0] for i in (0, 5, 41)]
    random.seed(1234)
    second = [ds[i][0] for i in (0, 5, 41)]
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_training_augmentation_varies_across_seeds(tiny_images: Path, saved_rngs: None) -> None:
    ds = ImageFolder(tiny_images / "train", image_size=32, train=True)
    samples = []
    for seed in range(6):
        random.seed(seed)
        samples.append(ds[3][0])
    distinct = {bytes(s.numpy().tobytes()) for s in samples}
    assert len(distinct) == len(samples), "different seeds gave identical crops"


def _corrupt(path: Path, kind: str, good: Path) -> None:
    if kind == "garbage":
        path.write_bytes(b"this is not a JPEG at all \x00\xff" * 50)
    elif kind == "truncated":
        data = good.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "empty":
        path.write_bytes(b"")
    else:  # pragma: no cover
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["garbage", "truncated", "empty"])
@pytest.mark.parametrize("decode", ["draft", "full"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "val"])
def test_broken_file_raises_corrupt_image_error_naming_the_file(tmp_path: Path, tiny_images: Path,
                                                                kind: str, decode: str, train: bool) -> None:
    root = _one_class_folder(tmp_path, tiny_images, n=1)
    good = next((root / "a").glob("*.jpg"))
    bad = root / "a" / "zz-broken.jpg"
    _corrupt(bad, kind, good)
    ds = ImageFolder(root, image_size=32, train=train, decode=decode)
    index = [ds.path(i) for i in range(len(ds))].index(str(bad))
    with pytest.raises(CorruptImageError, match=re.escape(str(bad))) as info:
        ds[index]
    assert isinstance(info.value, RuntimeError)
    assert info.value.__cause__ is not None
    assert ds[1 - index][0].shape == (3, 32, 32)  # the good file next to it still loads


def _write_inputs(folder: Path, tiny_jpeg: Path) -> dict[str, Path]:
    folder.mkdir(parents=True)
    with Image.open(tiny_jpeg) as im:
        rgb = im.convert("RGB")
    files = {
        "png_rgb": folder / "rgb.png",
        "png_rgba": folder / "rgba.png",
        "png_palette": folder / "palette.png",
        "jpeg_gray": folder / "gray.jpg",
        "png_gray": folder / "gray.png",
        "jpeg_upper_suffix": folder / "upper.JPEG",
    }
    rgb.save(files["png_rgb"])
    rgb.convert("RGBA").save(files["png_rgba"])
    rgb.convert("P").save(files["png_palette"])
    rgb.convert("L").save(files["jpeg_gray"], quality=90)
    rgb.convert("L").save(files["png_gray"])
    rgb.save(files["jpeg_upper_suffix"], format="JPEG", quality=90)
    (folder / "notes.txt").write_text("not an image")
    return files


@pytest.mark.parametrize("decode", ["draft", "full"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "val"])
def test_png_grayscale_and_palette_inputs_become_rgb(tmp_path: Path, tiny_images: Path, saved_rngs: None,
                                                     decode: str, train: bool) -> None:
    tiny_jpeg = next((tiny_images / "train" / "star").glob("*.jpg"))
    files = _write_inputs(tmp_path / "root" / "mixed", tiny_jpeg)
    ds = ImageFolder(tmp_path / "root", image_size=24, train=train, decode=decode)
    assert len(ds) == len(files)  # notes.txt is skipped
    by_path = {ds.path(i): i for i in range(len(ds))}
    random.seed(0)
    for name, path in files.items():
        x, y = ds[by_path[str(path)]]
        assert x.shape == (3, 24, 24), name
        assert x.dtype == torch.uint8, name
        assert y == 0
        if "gray" in name:
            assert torch.equal(x[0], x[1]) and torch.equal(x[1], x[2]), f"{name}: gray channels differ"


def test_missing_root_names_the_folder(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    pattern = rf"{re.escape(repr(str(missing)))} does not exist.*<root>/<class>/<image>"
    with pytest.raises(FileNotFoundError, match=pattern):
        ImageFolder(missing)


def test_root_that_is_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "file.jpg"
    f.write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ImageFolder(f)


@pytest.mark.parametrize("layout", ["empty", "empty_class_folders", "no_image_suffixes", "images_not_in_class_folders"])
def test_root_without_images_says_what_layout_is_expected(tmp_path: Path, tiny_images: Path, layout: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    if layout == "empty_class_folders":
        (root / "a").mkdir()
        (root / "b").mkdir()
    elif layout == "no_image_suffixes":
        (root / "a").mkdir()
        (root / "a" / "readme.txt").write_text("x")
    elif layout == "images_not_in_class_folders":
        shutil.copy(next((tiny_images / "train" / "circle").glob("*.jpg")), root / "flat.jpg")
    with pytest.raises(FileNotFoundError, match=rf"no images \(.*\.jpg.*\.png.*\) under {re.escape(repr(str(root)))}"
                                                r".*<root>/<class>/<image>"):
        ImageFolder(root)


@pytest.mark.parametrize("decode", ["fast", "DRAFT", "", "pillow"])
def test_bad_decode_value_lists_the_choices(tiny_images: Path, decode: str) -> None:
    with pytest.raises(ValueError, match=rf"decode={re.escape(repr(decode))} is not valid; choose 'draft' or 'full'"):
        ImageFolder(tiny_images / "val", decode=decode)


@pytest.mark.parametrize("image_size", [7, 1, 0, -32])
def test_too_small_image_size_is_refused(tiny_images: Path, image_size: int) -> None:
    with pytest.raises(ValueError, match=rf"image_size={image_size} is too small; use 8 or more"):
        ImageFolder(tiny_images / "val", image_size=image_size)


def test_image_size_8_is_the_smallest_accepted(tiny_images: Path) -> None:
    assert ImageFolder(tiny_images / "val", image_size=8, train=False)[0][0].shape == (3, 8, 8)
