"""Command-line flags generated from a config dataclass, so the help text is written once (in the config)."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

from trainfast.data.images import OnBadSample
from trainfast.data.packing import INDEX_NAME
from trainfast.data.remote import DataRoot, ObjectStore, RemoteSupportMissing, check_scheme, is_url
from trainfast.data.splits import ImageData, has_split, open_split
from trainfast.loader.auto import Auto
from trainfast.loader.options import Tuned, parse_workers

# `--on-bad-sample` -> ImageFolder(on_bad_sample=...)
ON_BAD_SAMPLE: dict[str, OnBadSample] = {"error": "raise", "skip": "skip"}


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; use a positive integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not valid; use a positive integer")
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give seconds > 0") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not valid; give seconds > 0")
    return value


def data_root(text: str) -> DataRoot:
    """`--data`: a URL (http(s)://, s3://) as given, else a local folder (`~` expanded)."""
    if is_url(text):
        return text
    try:
        check_scheme(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return Path(text).expanduser()


def workers_arg(text: str) -> int | Auto | Tuned:
    """`--workers` of every command that sets loader workers: `parse_workers` (the rule `make_loader` and
    `LoaderOptions` check too), its ValueError argparse's error."""
    try:
        return parse_workers(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _converter(tp: Any, name: str) -> tuple[Any, bool]:
    """(argparse type function, is-bool) for a field's type hint."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    optional = type(None) in typing.get_args(tp)
    if tp is bool:
        return None, True
    base = args[0] if args and typing.get_origin(tp) in (typing.Union, types.UnionType) else tp
    accepts_str = str in args
    kinds = [a for a in (args or [tp]) if a in (int, float)]
    literals = [v for a in args if typing.get_origin(a) is typing.Literal for v in typing.get_args(a)]

    def convert(text: str) -> Any:
        if optional and text.lower() == "none":
            return None
        if text in literals:  # `int | Literal["auto"]`: the word itself
            return text
        if bool in args and text.lower() in _BOOLS:
            return _BOOLS[text.lower()]
        for kind in kinds:
            try:
                return kind(text)
            except ValueError:
                pass
        if accepts_str or base is str:
            return text
        what = " or ".join([k.__name__ for k in kinds] + (["true/false"] if bool in args else [])
                           + [repr(v) for v in literals] + (["'none'"] if optional else []))
        raise argparse.ArgumentTypeError(f"{text!r} is not valid for --{name.replace('_', '-')}; expected {what}")

    return convert, False


def add_config_flags(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = (),
                     defaults: dict[str, Any] | None = None) -> None:
    """One `--flag` per dataclass field (bools get `--x/--no-x`); defaults come from the dataclass.

    No flag for a field in `skip`, a nested dataclass, or a field whose metadata says `flag=False` (an object
    such as a function, which no command line can give)."""
    hints = typing.get_type_hints(cls)
    defaults = defaults or {}
    for f in dataclasses.fields(cls):
        if f.name in skip or dataclasses.is_dataclass(hints[f.name]) or f.metadata.get("flag", True) is False:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = defaults.get(f.name, f.default)
        help_text = f"{f.metadata.get('help', '')} (default: {default})"
        convert, is_bool = _converter(hints[f.name], f.name)
        if is_bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif "bare" in f.metadata:  # `--x` alone means the bare value, `--x VALUE` the value, `--no-x` False
            parser.add_argument(flag, type=convert, nargs="?", const=f.metadata["bare"], default=default,
                                help=help_text, metavar=f.name.upper())
            parser.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", help=argparse.SUPPRESS)
        else:
            choices = f.metadata.get("choices")
            parser.add_argument(flag, type=convert, default=default, help=help_text, choices=choices,
                                metavar=None if choices else f.name.upper())


def config_values(args: argparse.Namespace, cls: type, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The parsed values of `cls`'s fields, ready for `cls(**values)`."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if f.name not in skip and hasattr(args, f.name)}


def add_on_bad_sample_flag(parser: argparse.ArgumentParser) -> None:
    """`--on-bad-sample {error,skip}` for a command that reads `--data`'s images."""
    parser.add_argument("--on-bad-sample", choices=tuple(ON_BAD_SAMPLE), default="error",
                        help="a corrupt or truncated image: 'error' stops with its name, 'skip' logs it and uses the "
                             "next image (stops past 1%% of the samples) (default: error)")


def check_data_root(root: DataRoot, parser: argparse.ArgumentParser) -> None:
    """`--data ROOT` must hold ROOT/train/<class>/<image> (a URL: ROOT/train/index.json): exit 2 naming what is
    missing otherwise."""
    if isinstance(root, str):
        try:
            found = ObjectStore(root).exists(f"train/{INDEX_NAME}")
        except (RemoteSupportMissing, ValueError) as e:
            parser.error(f"--data {root!r}: {e}")
        if not found:
            parser.error(f"--data {root!r} has no train/{INDEX_NAME}; a URL must hold a 'trainfast pack' output "
                         f"with train/ (and optionally val/): pack one there with 'trainfast pack SRC {root}' "
                         "(SRC/train/<class>/<image>)")
        return
    if not root.is_dir():
        parser.error(f"--data {str(root)!r} does not exist; give a folder holding train/<class>/<image>")
    if (root / INDEX_NAME).is_file() and not (root / "train").is_dir():  # `pack` of a folder without splits
        parser.error(f"--data {str(root)!r} is one packed split (its {INDEX_NAME} is at the top); --data takes a "
                     f"folder holding it as train/: move it to a new folder's train/ (and a packed val/ beside "
                     "it), or pack a source laid out as SRC/train/<class>/<image>")
    if not (root / "train").is_dir():
        parser.error(f"--data {str(root)!r} has no 'train' folder; expected {root}/train/<class>/<image> "
                     f"and optionally {root}/val/<class>/<image>")


def open_data(root: DataRoot, parser: argparse.ArgumentParser, *, image_size: int, on_bad_sample: str = "error",
              val: bool = True) -> tuple[ImageData, ImageData | None]:
    """`--data ROOT`'s training set and validation set (None without ROOT/val, or with `val=False`): `PackedImages`
    for a folder written by `trainfast pack` (ROOT/train/index.json), else `ImageFolder` (with `--on-bad-sample`;
    packed data has nothing to skip, `pack` left the corrupt images out). Exits 2 naming what is wrong: ROOT or
    ROOT/train missing, no images, an index `pack` must write again."""
    check_data_root(root, parser)
    bad = ON_BAD_SAMPLE[on_bad_sample]
    try:
        train_set = open_split(root, "train", image_size=image_size, on_bad_sample=bad)
        val_set = (open_split(root, "val", image_size=image_size, train=False, on_bad_sample=bad)
                   if val and has_split(root, "val") else None)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    return train_set, val_set
