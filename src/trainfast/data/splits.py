"""What a data root holds, decided in one place (`trainfast train`, `tune` and `bench` read `--data` with it): an
image folder (ROOT/train/<class>/<image>, optionally ROOT/val/<class>/<image>) or a folder written by
`trainfast pack` (ROOT/train/index.json and its shards, optionally ROOT/val/index.json). A URL ROOT
(http(s)://, s3://) must be packed: it is read with `PackedImages`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from trainfast.data.images import ImageFolder, OnBadSample
from trainfast.data.packed import PackedImages
from trainfast.data.packing import INDEX_NAME
from trainfast.data.remote import DataRoot, ObjectStore, is_url

ImageData = ImageFolder | PackedImages
DataFormat = Literal["image_folder", "packed"]


def is_packed(root: DataRoot) -> bool:
    """ROOT was written by `trainfast pack` (ROOT/train/index.json); a URL is always read as packed."""
    return is_url(root) or (Path(root) / "train" / INDEX_NAME).is_file()


def data_format(root: DataRoot) -> DataFormat:
    return "packed" if is_packed(root) else "image_folder"


def has_split(root: DataRoot, split: str) -> bool:
    """ROOT/split exists in ROOT's format: ROOT/split/index.json for a packed ROOT, the folder otherwise."""
    if isinstance(root, str) and is_url(root):
        return ObjectStore(root).exists(f"{split}/{INDEX_NAME}")
    root = Path(root)
    return (root / split / INDEX_NAME).is_file() if is_packed(root) else (root / split).is_dir()


def open_split(root: DataRoot, split: str = "train", *, image_size: int = 64, train: bool = True, decode: str = "draft",
               on_bad_sample: OnBadSample = "raise") -> ImageData:
    """ROOT/split as a dataset: `PackedImages` for a packed ROOT, else `ImageFolder`. `on_bad_sample` applies to
    an image folder only: `pack` already left the corrupt images out. Raises FileNotFoundError or ValueError (a
    missing split, no images, an index of another version) naming the path."""
    if isinstance(root, str) and is_url(root):
        return PackedImages(f"{root.rstrip('/')}/{split}", image_size=image_size, train=train, decode=decode)
    root = Path(root)
    if is_packed(root):
        return PackedImages(root / split, image_size=image_size, train=train, decode=decode)
    return ImageFolder(root / split, image_size=image_size, train=train, decode=decode, on_bad_sample=on_bad_sample)


def describe_packed(dataset: PackedImages) -> str:
    """`N images in S shard(s), packed at shorter side <= PX px` for messages."""
    max_size = dataset.settings.get("max_size")
    sized = f", shorter side at most {max_size} px" if max_size else ""
    return f"{len(dataset):,} images in {dataset.shards} shard(s){sized}"
