"""Writing a command's JSON result atomically (never half a file for the tool that reads it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, BinaryIO

from trainfast.atomic import atomic_write


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    data = (json.dumps(payload, indent=2, default=str) + "\n").encode()

    def write(f: BinaryIO) -> None:
        f.write(data)
    return atomic_write(path, write)
