"""The report's figures in words, for the terminal and the HTML page alike."""

from __future__ import annotations

import os
from collections.abc import Mapping
from decimal import ROUND_HALF_UP, Decimal
from typing import Any


def compute_line(compute: dict[str, Any]) -> str:
    """The `compute` entry in words: FLOPs per step, the rate achieved and how far it is from the peak."""
    flops = compute.get("flops_per_step")
    if flops is None or compute.get("achieved_flops_per_s") is None:
        return f"compute: FLOPs not counted ({compute.get('reason') or 'unknown'})"
    head = (f"compute: {flops / 1e9:,.2f} GFLOP per step, {compute['achieved_flops_per_s'] / 1e9:,.1f} GFLOP/s "
            f"achieved; peak {compute['peak_flops_per_s'] / 1e9:,.0f} GFLOP/s ({compute['peak_source']})")
    if compute.get("mfu") is None:
        return f"{head}; MFU not reported: {compute.get('mfu_error')}"
    return f"{head}: MFU {compute['mfu']:.1%}"


def oom_headline(oom: dict[str, Any]) -> str:
    """Where the script ran out of memory (the `oom` entry's step and device)."""
    step = oom.get("step")
    where = f"at step {step}" if step is not None else "before its first training step"
    return f"the script ran out of memory {where}" + (f" on {oom['device']}" if oom.get("device") else "")


def oom_paragraph(oom: dict[str, Any], *, headline: bool = True) -> str:
    """The `oom` entry in words: where, the error's first line, what the allocator held and what to change."""
    parts = (str(oom.get("message") or "out of memory"), str(oom.get("advice") or ""))
    detail = " ".join(f"{part.rstrip('.')}." for part in parts if part)
    return f"{oom_headline(oom)}: {detail}" if headline else detail


def lost_progress_line(lost: dict[str, Any]) -> str:
    """`lost_progress` in words: the steps trained again after torchrun's restarts, and the restarts' time."""
    parts = []
    for a in lost["attempts"]:
        if not a["recorded"]:
            parts.append(f"attempt {a['attempt']}: no record (torchrun's store did not keep it)")
            continue
        bound = "" if a["exact"] else "at least "
        since = (f"its last checkpoint (step {a['checkpoint_steps']})" if a["checkpoint_steps"] is not None
                 else "its start (no checkpoint write seen)")
        restart = f"; the restart took {a['restart_s']:.1f} s" if a["restart_s"] is not None else ""
        parts.append(f"attempt {a['attempt']} ended at step {a['steps']} ({a['ended'] or 'killed'}): {bound}"
                     f"{a['steps_lost']} step(s), {bound}{a['seconds_lost']:.1f} s since {since} were trained "
                     f"again{restart}")
    return (f"{lost['restarts']} restart(s), {lost['steps']} step(s) and {lost['seconds'] + lost['restart_s']:.1f} s "
            f"outside this attempt's wall time — " + "; ".join(parts))


def gain(value: float) -> str:
    """A gain as the report's JSON holds it (3 decimals), shown to 2, half up: 1.255 reads "1.26x", as a reader of
    the JSON would round it (binary floating point would print 1.25)."""
    return f"{Decimal(repr(value)).quantize(Decimal('0.01'), ROUND_HALF_UP)}x"


def where_line(where: Mapping[str, Any]) -> str:
    """Where a fix is made permanent: the script's file:line and its code, and, where a framework made the object or
    called that code, the framework's own setting for the fix (a second line)."""
    at = f"where: {_shown(where['file'])}:{where['line']}  {where['code']}" if where.get("file") else ""
    if where.get("framework"):
        setting = f"{where['framework']}'s setting: {where['setting']}"
        return f"{at}\n{setting}" if at else setting
    return at


def _shown(path: str) -> str:
    """A path as the user reads it: relative to the working folder when it is under it."""
    try:
        return os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
    except ValueError:  # another drive (Windows)
        return path
