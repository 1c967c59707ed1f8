"""Writing a command's JSON result atomically (never half a file for the tool that reads it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainfast.atomic import atomic_write


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    text = json.dumps(payload, indent=2, default=str) + "\n"
    return atomic_write(path, lambda f: f.write(text.encode()))
