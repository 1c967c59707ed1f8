"""format_bytes: the one byte formatter of messages, tables and reports."""

from __future__ import annotations

import pytest

from trainfast.units import format_bytes


@pytest.mark.parametrize(("n", "text"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (512 * 2**10, "512.0 KiB"), (300 * 2**20, "300.0 MiB"),
    (3 * 2**30, "3.0 GiB"), (1536 * 2**30, "1.5 TiB"), (2048 * 2**40, "2,048.0 TiB"), (-64 * 2**20, "-64.0 MiB"),
])
def test_each_size_in_its_largest_unit(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_missing_values_say_so() -> None:
    assert format_bytes(None) == "unknown" and format_bytes(None, missing="–") == "–"
