"""Atomic file writes: a reader, a crash or a power cut sees the old file or the whole new one, never a torn one.

Write a temporary file *in the target folder* (a rename is atomic only within one file system), flush
and fsync it, `os.replace` it over the target, then fsync the folder so the rename itself is durable.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

TEMP_PREFIX = ".trainfast-"


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
    data = text.encode()

    def write(f: BinaryIO) -> None:
        f.write(data)
    return atomic_write(path, write)


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """`payload` as indented JSON, written atomically (a reader never sees half a file)."""
    return write_text(path, json.dumps(payload, indent=2, default=str) + "\n")
