"""Checkpoints that survive crashes: atomic writes, verified reads, RNG state in `weights_only` form.

A checkpoint is one `torch.save` zip, written atomically (see `trainfast.atomic`): a crash at any
instant leaves either the old or the new file, never a torn one. `torch.load` does not check the
zip's CRCs, so a flipped byte inside a tensor would load silently; `load_checkpoint` checks them first.
"""

from __future__ import annotations

import logging
import platform
import random
import zipfile
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from trainfast.atomic import TEMP_PREFIX, atomic_write

log = logging.getLogger("trainfast")


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, corrupt, or not a trainfast checkpoint; the message names it."""


def atomic_save(obj: Any, path: str | Path) -> Path:
    """`torch.save(obj)` to `path` so that `path` is always either the previous file or the complete new one."""
    return atomic_write(path, lambda f: torch.save(obj, f))


def rotated(path: Path, keep: int) -> list[Path]:
    """`last.pt`, `last.1.pt`, ... `last.{keep-1}.pt`: newest first."""
    return [path] + [path.with_name(f"{path.stem}.{i}{path.suffix}") for i in range(1, keep)]


def rotate(path: Path, keep: int) -> None:
    """Shift the kept checkpoints down one place before a new `path` is written (renames are atomic): a crash
    in between leaves no `path`, and resume falls back to the next one."""
    names = rotated(path, keep)
    for older, newer in zip(reversed(names[1:]), reversed(names[:-1]), strict=True):
        if newer.exists():
            newer.replace(older)


def load_latest_good(path: Path, keep: int, map_location: str | torch.device = "cpu",
                     trusted: bool = False) -> tuple[Path, dict[str, Any]] | None:
    """The newest of the kept checkpoints that verifies; says which were skipped and why. None if none exist."""
    errors = []
    for candidate in rotated(path, keep):
        if not candidate.exists():
            continue
        try:
            state = load_checkpoint(candidate, map_location=map_location, trusted=trusted)
        except CheckpointError as e:
            errors.append(str(e))
            continue
        for error in errors:
            log.warning("%s; falling back to %s", error, candidate)
        return candidate, state
    if errors:
        raise CheckpointError("no usable checkpoint: " + "; ".join(errors))
    return None


def clean_stale_temps(folder: Path) -> list[Path]:
    """Remove temporary files a process killed mid-write left behind (never the checkpoints themselves)."""
    removed = []
    if folder.is_dir():
        for stale in folder.glob(f"{TEMP_PREFIX}*.tmp"):
            stale.unlink(missing_ok=True)
            removed.append(stale)
    if removed:
        log.info("removed %d unfinished checkpoint write(s) from %s", len(removed), folder)
    return removed


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", *,
                    trusted: bool = False) -> dict[str, Any]:
    """Verify the zip CRCs, then `torch.load(..., weights_only=True)`: no pickle code ever runs.

    `trusted=True` allows arbitrary pickled objects (and so arbitrary code): only for files you made.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {str(path)!r}")
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    except (zipfile.BadZipFile, OSError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r} is truncated or not a torch.save file ({e})") from e
    if bad is not None:
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: CRC mismatch in {bad!r}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=not trusted)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, ... for unsafe or damaged content
        hint = "" if trusted else (" (it holds objects beyond tensors and plain values; load it with trusted=True "
                                   "only if you made it yourself: unpickling runs code)")
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be loaded safely: {e}{hint}") from e
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{str(path)!r} is not a trainfast checkpoint (no 'model' entry)")
    return state


def rng_state() -> dict[str, Any]:
    """torch, CUDA, numpy and Python RNG states as tensors, ints and lists (loadable with weights_only)."""
    _, keys, pos, has_gauss, gauss = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state(legacy=True))
    version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                  "gauss": float(gauss)},
        "python": {"version": version, "state": list(py_state), "gauss": py_gauss},
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))


def versions() -> dict[str, str]:
    from trainfast import __version__

    return {"trainfast": __version__, "torch": str(torch.__version__), "numpy": np.__version__,
            "python": platform.python_version(), "cuda": str(torch.version.cuda)}
