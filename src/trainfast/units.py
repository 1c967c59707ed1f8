"""Byte counts as people read them, written once for every message, table and report."""

from __future__ import annotations

KIB, MIB, GIB, TIB = 2**10, 2**20, 2**30, 2**40


def format_bytes(n: float | None, *, missing: str = "unknown") -> str:
    """`n` bytes as "512.0 KiB" / "64.0 MiB" / "7.8 GiB" (`missing` for None)."""
    if n is None:
        return missing
    for unit, size in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{int(n)} B"
