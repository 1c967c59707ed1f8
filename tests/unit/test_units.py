"""format_bytes and to_bytes: the one byte formatter of messages, tables and reports, and the one unit table."""

from __future__ import annotations

import pytest

from trainfast.units import format_bytes, to_bytes


@pytest.mark.parametrize(("n", "text"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (512 * 2**10, "512.0 KiB"), (300 * 2**20, "300.0 MiB"),
    (3 * 2**30, "3.0 GiB"), (1536 * 2**30, "1.5 TiB"), (2048 * 2**40, "2,048.0 TiB"), (-64 * 2**20, "-64.0 MiB"),
])
def test_each_size_in_its_largest_unit(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_missing_values_say_so() -> None:
    assert format_bytes(None) == "unknown" and format_bytes(None, missing="–") == "–"


@pytest.mark.parametrize(("amount", "unit", "n"), [
    (64, "MiB", 64 * 2**20), (64, "mib", 64 * 2**20), (500, "MB", 500 * 10**6), (2.5, "GiB", int(2.5 * 2**30)),
    (3, "", 3), (20, "bytes", 20), (1, "TiB", 2**40), (8, "k", 8000),
])
def test_units_as_people_and_torch_write_them(amount: float, unit: str, n: int) -> None:
    assert to_bytes(amount, unit) == n


def test_an_unknown_unit_is_none() -> None:
    assert to_bytes(1, "parsecs") is None
