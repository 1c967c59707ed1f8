"""Atomic file writes: a reader, a crash or a power cut sees the old file or the whole new one, never a torn one.

Write a temporary file *in the target folder* (a rename is atomic only within one file system), flush
and fsync it, `os.replace` it over the target, then fsync the folder so the rename itself is durable.

`write_failure` is the one place that decides whether an exception raised while writing means the write failed
(a full volume, a quota, permissions) rather than a bug, and `describe_write_failure` says so in one message.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from trainfast.units import format_bytes

TEMP_PREFIX = ".trainfast-"
NO_ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# torch.save writes through its C++ zip writer (PytorchStreamWriter), which reports a short write as a RuntimeError,
# not an OSError. On a full 2 MiB tmpfs: "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
# (write_end_of_file); elsewhere "PytorchStreamWriter failed writing file data/0: file write failed".
TORCH_WRITE_FAILURES = ("unexpected pos", "file write failed", "PytorchStreamWriter failed")
# __cause__/__context__ links followed to find the OSError under torch's RuntimeError (it is the first link)
_CHAIN_DEPTH = 8


def temp_path(path: Path) -> Path:
    return path.with_name(f"{TEMP_PREFIX}{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> Path:
    """Call `write(f)` on a temporary file, then move it over `path` (created with the usual umask permissions)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # not every platform can open a folder
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_copy(src: str | Path, dst: str | Path) -> Path:
    """Copy `src` over `dst` atomically."""
    def copy(f: BinaryIO) -> None:
        with open(src, "rb") as source:
            shutil.copyfileobj(source, f, length=1 << 20)
    return atomic_write(dst, copy)


def write_text(path: str | Path, text: str) -> Path:
    """`text` (UTF-8) written atomically."""
    return write_bytes(path, text.encode())


def write_bytes(path: str | Path, data: bytes) -> Path:
    """`data` written atomically."""
    def write(f: BinaryIO) -> None:
        f.write(data)
    return atomic_write(path, write)


def json_text(payload: dict[str, Any]) -> str:
    """`payload` as the indented JSON that `write_json` writes."""
    return json.dumps(payload, indent=2, default=str) + "\n"


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """`payload` as indented JSON, written atomically (a reader never sees half a file)."""
    return write_text(path, json_text(payload))


@dataclass(frozen=True)
class WriteFailure:
    """Why a file could not be written: the reason as the OS (or torch's writer) gave it, and the errno if known."""

    reason: str
    errno: int | None = None

    def __str__(self) -> str:
        return self.reason if self.errno is None else f"{self.reason} (errno {self.errno})"

    def no_room(self, free_bytes: int | None, needed_bytes: int) -> bool | None:
        """True for a full volume or a quota, False for another cause (permissions, a failing disk), None when
        unknown. Without an errno (torch's writer gives none), fewer bytes free than the file needs (measured after
        its temporary file was removed) means no room; more, or an unknown free space, leaves the cause unknown."""
        if self.errno is not None:
            return self.errno in NO_ROOM_ERRNOS
        if free_bytes is not None and free_bytes < needed_bytes:
            return True
        return None


def write_failure(error: BaseException) -> WriteFailure | None:
    """`error`, raised while writing a file, as a failed write; None when it is not one (a bug keeps its traceback).

    A failed write is an OSError, or a RuntimeError from torch's zip writer: one that wraps the OSError of the file
    it wrote to (as its __cause__ or __context__; ENOSPC on a full volume), or whose message says a write came up
    short (`TORCH_WRITE_FAILURES`)."""
    if isinstance(error, OSError):
        return WriteFailure(error.strerror or str(error), error.errno)
    if not isinstance(error, RuntimeError):
        return None
    inner = _chained_os_error(error)
    text = str(error)
    if inner is not None and (inner.errno in NO_ROOM_ERRNOS or any(s in text for s in TORCH_WRITE_FAILURES)):
        return WriteFailure(inner.strerror or str(inner), inner.errno)
    if any(s in text for s in TORCH_WRITE_FAILURES):
        return WriteFailure(f"torch's zip writer failed ({text.strip().splitlines()[0]})")
    return None


def as_write_failure(error: BaseException) -> WriteFailure:
    """`write_failure(error)`, called in an `except` block; `error` is raised again when it is no failed write (a
    bug keeps its traceback)."""
    failure = write_failure(error)
    if failure is None:
        raise error
    return failure


def _chained_os_error(error: BaseException) -> OSError | None:
    seen: set[int] = set()
    link = error.__cause__ or error.__context__
    while link is not None and id(link) not in seen and len(seen) < _CHAIN_DEPTH:
        if isinstance(link, OSError):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the volume of `path` (or of its nearest existing parent: a checkpoint folder may not exist yet);
    None where it cannot be read."""
    for candidate in (Path(path), *Path(path).parents):
        if candidate.exists():
            try:
                return int(shutil.disk_usage(candidate).free)
            except OSError:
                return None
    return None


def describe_write_failure(path: Path, needed_bytes: int, failure: WriteFailure, outcome: str, *, what: str,
                           room_fix: str, other_fix: str) -> str:
    """One message for a failed write: the file, why, the bytes free in its folder and needed, what happens now
    (`outcome`), and the fix for the cause (`room_fix` for a full volume, `other_fix` otherwise, both when
    unknown)."""
    folder = path.parent
    free = free_bytes(folder)
    no_room = failure.no_room(free, needed_bytes)
    fix = room_fix if no_room else other_fix if no_room is False else f"{room_fix}; if it has room, {other_fix}"
    return (f"could not write {what} {str(path)!r}: {failure}; {str(folder)!r} has {format_bytes(free)} free, the "
            f"file needs {format_bytes(needed_bytes)}. {outcome}. Fix: {fix}")


class OutputWriteError(RuntimeError):
    """An output file (a report, a summary) could not be written; the message names it, the bytes needed and free,
    and the fix. The work it reports on is done."""


def write_output(path: str | Path, content: str | bytes, *, what: str, outcome: str) -> Path:
    """`content` (text as UTF-8) written atomically to `path`; a failed write (see `write_failure`) raises
    `OutputWriteError`, so a full volume costs the file, never the run that made it (nor a torn file: the old one
    stays)."""
    path = Path(path)
    data = content.encode() if isinstance(content, str) else content
    try:
        return write_bytes(path, data)
    except Exception as e:
        failure = as_write_failure(e)
        folder = str(path.parent)
        raise OutputWriteError(describe_write_failure(
            path, len(data), failure, outcome, what=what,
            room_fix=f"free space in {folder!r}, or give a path on another volume",
            other_fix=f"make {folder!r} writable, or give a path elsewhere")) from e
