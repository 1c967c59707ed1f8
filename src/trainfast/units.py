"""Byte counts as people read them, written once for every message, table and report."""

from __future__ import annotations

KIB, MIB, GIB, TIB = 2**10, 2**20, 2**30, 2**40
# Unit names, lower-cased, as people and torch's messages write them: binary (KiB) and decimal (kB, k)
UNIT_BYTES = {"": 1, "b": 1, "bytes": 1, "k": 1000, "kb": 1000, "kib": KIB, "m": 1000**2, "mb": 1000**2, "mib": MIB,
              "g": 1000**3, "gb": 1000**3, "gib": GIB, "t": 1000**4, "tb": 1000**4, "tib": TIB}


def format_bytes(n: float | None, *, missing: str = "unknown") -> str:
    """`n` bytes as "512.0 KiB" / "64.0 MiB" / "7.8 GiB" (`missing` for None)."""
    if n is None:
        return missing
    for unit, size in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{int(n)} B"


def to_bytes(amount: float, unit: str) -> int | None:
    """`amount` `unit`s as bytes ("64", "MiB" -> 67108864; the unit in any case), None for an unknown unit."""
    size = UNIT_BYTES.get(unit.lower())
    return None if size is None else int(amount * size)
