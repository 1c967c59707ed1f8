"""One rule for the workers setting: `make_loader(workers=)`/`LoaderOptions` and every command's `--workers` accept
the same values and name the same choices when refusing one."""

from __future__ import annotations

import argparse
import re

import pytest

from trainfast.cli.flags import workers_arg
from trainfast.loader.options import WORKERS_VALID, LoaderOptions, parse_workers


@pytest.mark.parametrize(("text", "value"), [("auto", "auto"), ("tuned", "tuned"), ("0", 0), ("7", 7)])
def test_a_valid_text_is_the_value_the_library_takes(text: str, value: int | str) -> None:
    assert parse_workers(text) == workers_arg(text) == value
    assert LoaderOptions(workers=parse_workers(text)).workers == value


@pytest.mark.parametrize("text", ["-1", "many", "Auto", "", "2.5"])
def test_an_invalid_text_is_refused_alike(text: str) -> None:
    expected = f"{text!r} is not valid; use {WORKERS_VALID}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        parse_workers(text)
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{re.escape(expected)}$"):
        workers_arg(text)


@pytest.mark.parametrize("value", [-1, True, 2.0, "3", None])
def test_the_library_names_the_same_choices(value: object) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(f'workers={value!r} is not valid; use {WORKERS_VALID}')}$"):
        LoaderOptions(workers=value)  # type: ignore[arg-type]
