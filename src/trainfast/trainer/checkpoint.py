"""Checkpoints that survive crashes: atomic writes, verified reads, RNG state in `weights_only` form.

A checkpoint is one `torch.save` zip, written atomically (see `trainfast.atomic`): a crash at any
instant leaves either the old or the new file, never a torn one. `torch.load` does not check the
zip's CRCs, so a flipped byte inside a tensor would load silently; `load_checkpoint` checks them first.

Resuming loads every piece on the CPU, whatever device trains: `load_state_dict` copies the model's and the
optimizer's tensors to their parameters' device, and RNG states must be CPU ByteTensors (a CUDA-mapped
one makes `torch.set_rng_state` refuse it).

A write that fails (a full disk, a quota, a read-only folder) raises `CheckpointWriteError`: its message
names the folder, the bytes needed and free, and the intact checkpoint to resume from. On a full volume torch's
zip writer raises a RuntimeError, not an OSError; `trainfast.atomic.write_failure` recognises both.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import pickle
import platform
import random
import zipfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from trainfast.atomic import TEMP_PREFIX, WriteFailure, as_write_failure, atomic_copy, atomic_write
from trainfast.atomic import describe_write_failure as describe_failed_write
from trainfast.envcheck.checks import Check
from trainfast.envcheck.environment import checkpoint_preflight
from trainfast.version import __version__

log = logging.getLogger("trainfast")
# Beyond the model and optimizer tensors a checkpoint holds RNG states, the config and zip headers: 18 KiB
# for a one-layer model here.
METADATA_BYTES = 20 * 1024


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, corrupt, or not a trainfast checkpoint; the message names it."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint to resume from could not be written (no space, a quota, permissions); training stopped.

    The message names the folder, the bytes needed and free, and the intact checkpoint to resume from."""


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


def unrotate(path: Path, keep: int) -> None:
    """Undo `rotate` after the new `path` could not be written, so `path` names the newest intact checkpoint
    again (the oldest one, dropped by the rotation, stays gone). Never overwrites a file."""
    names = rotated(path, keep)
    for newer, older in itertools.pairwise(names):
        if older.exists() and not newer.exists():
            older.replace(newer)


def resume_point(path: Path, keep: int) -> Path | None:
    """The newest kept checkpoint on disk (each was written atomically, so it is whole), or None."""
    return next((p for p in rotated(path, keep) if p.is_file()), None)


def state_bytes(obj: Any) -> int:
    """Tensor bytes in a (nested) state dict: what `torch.save` writes, give or take a few KiB of metadata."""
    if isinstance(obj, torch.Tensor):
        return int(obj.untyped_storage().nbytes()) if obj.device.type != "meta" else 0
    values: Iterable[Any] = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (list, tuple)) else ()
    return sum(state_bytes(v) for v in values)


def to_host(obj: Any) -> Any:
    """A copy of a (nested) state dict that training can no longer change: every tensor in host memory, dicts, lists
    and tuples rebuilt, other values (numbers, strings) as they are. A background write saves it while the next
    epoch trains: the state dicts hold the live parameters, moments and step counters, and even their containers
    (an optimizer's per-parameter state).

    Each storage is copied once and its tensors rebuilt on the copy, so tensors that share a storage (tied
    weights) still share it, and the file holds what `torch.save` of the original would hold; layouts
    (channels_last) are kept. Objects met twice (the RNG state under "rng" and "rng_per_rank") are copied once."""
    return _to_host(obj, {})


def _to_host(obj: Any, memo: dict[Any, Any]) -> Any:
    if id(obj) in memo:
        return memo[id(obj)]
    out: Any
    if isinstance(obj, torch.Tensor):
        out = _tensor_to_host(obj, memo)
    elif isinstance(obj, dict):
        out = copy.copy(obj)  # the same mapping type, with its attributes (a state dict's `_metadata`)
        memo[id(obj)] = out
        for key, value in obj.items():
            out[key] = _to_host(value, memo)
    elif isinstance(obj, list):
        out = []
        memo[id(obj)] = out
        out.extend(_to_host(value, memo) for value in obj)
    elif isinstance(obj, tuple):
        items = [_to_host(value, memo) for value in obj]
        out = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)  # a namedtuple takes its fields
    else:
        return obj
    memo[id(obj)] = out
    return out


def _tensor_to_host(tensor: torch.Tensor, memo: dict[Any, Any]) -> torch.Tensor:
    t = tensor.detach()
    if t.device.type == "meta":
        return t  # no data to copy
    if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_quantized:
        return t.clone() if t.device.type == "cpu" else t.to("cpu", copy=True)
    storage = t.untyped_storage()
    key = ("storage", str(t.device), storage.data_ptr(), storage.nbytes())
    host = memo.get(key)
    if host is None:  # a blocking copy: once it returns, training may change the original
        host = memo[key] = storage.clone() if t.device.type == "cpu" else storage.cpu()
    return torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())


def estimate_checkpoint_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes one checkpoint of `model` and `optimizer` will take. Before the first step an optimizer holds no
    state yet: assume what it will hold, 2 copies of each trained parameter for Adam-style ones (AdamW's two
    moments), 1 for SGD with momentum, none for plain SGD."""
    held = state_bytes(optimizer.state_dict()["state"])
    if held == 0:
        trained = sum(p.numel() * p.element_size() for g in optimizer.param_groups for p in g["params"]
                      if p.requires_grad)
        if isinstance(optimizer, torch.optim.SGD):
            copies = 1 if any(g.get("momentum") for g in optimizer.param_groups) else 0
        else:
            copies = 2
        held = copies * trained
    return state_bytes(model.state_dict()) + held + METADATA_BYTES


def room_for_checkpoints(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, keep: int) -> Check:
    """The pre-flight check of `folder`'s free space against the checkpoints a run will keep there."""
    return checkpoint_preflight(folder, estimate_checkpoint_bytes(model, optimizer), keep, kept_bytes(folder, keep))


def kept_bytes(folder: Path, keep: int) -> int:
    """Bytes of the checkpoints already in `folder` (`last.pt`, `last.N.pt`, `best.pt`): the new ones replace them."""
    total = 0
    for path in [*rotated(folder / "last.pt", keep), folder / "best.pt"]:
        with contextlib.suppress(OSError):
            total += path.stat().st_size
    return total


def describe_write_failure(path: Path, needed_bytes: int, failure: WriteFailure, outcome: str) -> str:
    """One message for a failed checkpoint write: the file, why, bytes needed and free, what happens now, and
    the fixes."""
    folder = str(path.parent)
    return describe_failed_write(
        path, needed_bytes, failure, outcome, what="checkpoint",
        room_fix=f"free space in {folder!r}, lower keep_checkpoints, or use another checkpoint_dir (--checkpoint-dir)",
        other_fix=f"make {folder!r} writable, or use another checkpoint_dir (--checkpoint-dir)")


def _size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0


def save_checkpoint(state: dict[str, Any], path: Path, keep: int) -> Path:
    """Write the resume point `path`, keeping the previous `keep - 1` beside it (`last.1.pt`, ...).

    A write that fails (a full disk, a quota, ...; see `write_failure`) leaves no temporary file, puts `path`
    back to the previous checkpoint and raises `CheckpointWriteError` naming it (or saying there is none). Any
    other exception puts `path` back too, and propagates as it is."""
    rotate(path, keep)
    try:
        return atomic_save(state, path)
    except BaseException as e:
        with contextlib.suppress(OSError):  # the renames failed too: resume still finds the newest kept file
            unrotate(path, keep)
        failure = as_write_failure(e)
        previous = resume_point(path, keep)
        outcome = (f"Training stopped; the last intact checkpoint is {str(previous)!r}: resume from it "
                   "(resume=True / --resume) once there is room" if previous is not None else
                   "Training stopped; no checkpoint was written yet, so there is none to resume from")
        # The new file is about as large as the previous one (same model and optimizer); before the first, the
        # tensor bytes (within 2% of the file: the rest is metadata).
        needed = max(state_bytes(state), _size(previous))
        raise CheckpointWriteError(describe_write_failure(path, needed, failure, outcome)) from e


def copy_best(last: Path, best: Path) -> Path | None:
    """Copy the just-written `last` to `best`. A failed copy only costs best.pt, never the run: it logs one
    warning naming the folder, the bytes and the intact resume point, and returns None."""
    try:
        return atomic_copy(last, best)
    except Exception as e:
        failure = as_write_failure(e)
        kept = "keeps the previous best" if best.is_file() else "was not written"
        log.warning("%s", describe_write_failure(
            best, _size(last), failure,
            f"Training goes on: {best.name} {kept}, and {str(last)!r} (the resume point) is intact"))
        return None


def first_good(candidates: Iterable[Path], load: Callable[[Path], dict[str, Any]]
               ) -> tuple[Path, dict[str, Any]] | None:
    """The first of `candidates` (newest first) that `load` verifies; says which were skipped and why. None if there
    are none; `CheckpointError` naming every reason if none loads."""
    errors = []
    for candidate in candidates:
        try:
            state = load(candidate)
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
    except pickle.UnpicklingError as e:  # weights_only refused an object beyond tensors and plain values
        hint = "" if trusted else (" (it holds objects beyond tensors and plain values; load it with trusted=True "
                                   "only if you made it yourself: unpickling runs code)")
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be loaded safely: {e}{hint}") from e
    except Exception as e:  # RuntimeError, ... for damaged content: trusting the file would not help
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be loaded: {e}") from e
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{str(path)!r} is not a trainfast checkpoint (no 'model' entry)")
    return state


def _cuda_index(device: torch.device | None) -> int | None:
    """The GPU whose CUDA generator an RNG state holds: `device`'s index where it is a GPU, none for another device;
    without a device, the current GPU where CUDA is available (what a caller naming none trains on)."""
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_available() else None
    if device.type != "cuda":
        return None
    return torch.cuda.current_device() if device.index is None else device.index


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """torch CPU, numpy and Python RNG states and the CUDA generator's of `device` (the training device), as tensors,
    ints and lists (loadable with weights_only).

    Only the training device's CUDA state: the run draws from no other GPU, and the machine that resumes may have
    fewer. "cuda" is a list of that one state ([] off the GPU) and "cuda_device" the GPU's index (None off the GPU);
    checkpoints written before "cuda_device" existed hold every visible GPU's state in "cuda", in index order.
    """
    _, keys, pos, has_gauss, gauss = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state(legacy=True))
    version, py_state, py_gauss = random.getstate()
    index = _cuda_index(device)
    return {
        "torch": torch.get_rng_state(),
        "cuda": [] if index is None else [torch.cuda.get_rng_state(torch.device("cuda", index))],
        "cuda_device": index,
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                  "gauss": float(gauss)},
        "python": {"version": version, "state": list(py_state), "gauss": py_gauss},
    }


def _byte_state(t: torch.Tensor) -> torch.Tensor:
    """torch and CUDA RNG states are only taken as CPU ByteTensors, wherever the checkpoint put them."""
    return t.detach().to(device="cpu", dtype=torch.uint8)


_warned_missing_cuda_state: set[int] = set()  # GPU indices already warned about: once per process


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore what `rng_state()` returned, from tensors on any device and of any integer dtype; the CUDA state goes to
    `device`'s generator (the training device; None: as `rng_state`).

    A state of one GPU is the training device's, whichever index it had when saved (a rank's stream is its own).
    An older checkpoint's list of every GPU's state gives the entry at `device`'s index; one without that entry
    (saved on a machine with fewer GPUs) leaves the CUDA generator as it is, with one warning."""
    torch.set_rng_state(_byte_state(state["torch"]))
    states = list(state.get("cuda") or [])
    index = _cuda_index(device) if states else None  # (a CPU run's checkpoint holds none: nothing to ask CUDA)
    if index is not None and states:
        cuda = torch.device("cuda", index)
        if "cuda_device" in state:
            torch.cuda.set_rng_state(_byte_state(states[0]), cuda)
        elif index < len(states):
            torch.cuda.set_rng_state(_byte_state(states[index]), cuda)
        elif index not in _warned_missing_cuda_state:
            _warned_missing_cuda_state.add(index)
            log.warning("resume: the checkpoint holds the CUDA RNG states of GPUs 0 to %d (written before a "
                        "checkpoint kept only the training GPU's) and none for %s, the GPU training here: its "
                        "generator keeps its current state, so random draws on the GPU (dropout) differ from an "
                        "uninterrupted run; everything else resumes exactly. For identical draws, resume on a GPU "
                        "index below %d", len(states) - 1, cuda, len(states))
    n = state["numpy"]
    keys = n["keys"].detach().cpu().numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, int(n["pos"]), int(n["has_gauss"]), float(n["gauss"])))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))


def versions() -> dict[str, str]:
    return {"trainfast": __version__, "torch": str(torch.__version__), "numpy": np.__version__,
            "python": platform.python_version(), "cuda": str(torch.version.cuda)}
