"""Kept for imports written before `write_json` moved to `trainfast.atomic`."""

from trainfast.atomic import write_json

__all__ = ["write_json"]
