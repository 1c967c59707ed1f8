"""Where trainfast keeps what it generates and measures (the demo dataset, tuning results): a leaf module."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$TRAINFAST_CACHE`, else `~/.cache/trainfast`."""
    env = os.environ.get("TRAINFAST_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "trainfast"
