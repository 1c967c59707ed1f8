"""Every `trainfast` command's flags, frozen: a flag added, removed or changed (name, value, choices, default)
must be deliberate, so this snapshot is updated with it, and docs/command-line.md and --help with it too.

After a deliberate change: TRAINFAST_UPDATE_SNAPSHOT=1 pytest tests/unit/cli/test_cli_flags_snapshot.py
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from trainfast.cli import build_parser

SNAPSHOT = Path(__file__).with_name("cli_flags.json")


def _value(value: Any) -> Any:
    """Defaults as JSON: plain values as they are, anything else (paths, functions) by its type's name."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_value(v) for v in value]
    return f"<{type(value).__name__}>"


def _flags(parser: argparse.ArgumentParser) -> list[dict[str, Any]]:
    flags = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        flags.append({"flags": list(action.option_strings) or [action.dest], "dest": action.dest,
                      "kind": type(action).__name__, "nargs": _value(action.nargs), "const": _value(action.const),
                      "default": _value(action.default),
                      "choices": _value(list(action.choices)) if action.choices is not None else None,
                      "required": action.required})
    return flags


def snapshot() -> dict[str, Any]:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"trainfast": _flags(parser)} | {name: _flags(sub) for name, sub in sorted(commands.choices.items())}


def test_every_command_s_flags_match_the_snapshot() -> None:
    now = snapshot()
    if os.environ.get("TRAINFAST_UPDATE_SNAPSHOT"):
        SNAPSHOT.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    frozen = json.loads(SNAPSHOT.read_text())
    for command in sorted(set(now) | set(frozen)):
        assert now.get(command) == frozen.get(command), (
            f"`trainfast {command}` flags changed; if deliberate, update docs/command-line.md and --help and run "
            "TRAINFAST_UPDATE_SNAPSHOT=1 pytest tests/unit/cli/test_cli_flags_snapshot.py")
