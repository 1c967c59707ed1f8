"""`trainfast doctor`'s own options against the script's: a `--` right after SCRIPT (argparse takes it in with
SCRIPT) still marks what follows as the script's, so the script's own `--steps` draws no warning."""

from __future__ import annotations

import pytest

from trainfast.cli import build_parser
from trainfast.cli.doctor import _doctor_options_after_script

WARNING = "after the script go to the script"


def script_args(argv: list[str]) -> tuple[list[str], int]:
    """(the script's arguments, the doctor's --steps) as `trainfast ARGV` gives them."""
    args = build_parser().parse_args(argv)
    given = list(args.script_args)
    if args.module and args.target is not None:  # as the command does: `-m mod -- a b` took `a` for SCRIPT
        given.insert(0, args.target)
    found = _doctor_options_after_script(given, args, args.command_parser, args.doctor_argv)
    return found, args.steps


@pytest.mark.parametrize(("argv", "expected"), [
    (["doctor", "--steps", "10", "train.py", "--", "--steps", "100"], (["--steps", "100"], 10)),
    (["doctor", "train.py", "--", "--steps", "100"], (["--steps", "100"], 30)),
    (["doctor", "--steps", "10", "-m", "pkg.train", "--", "--steps", "100"], (["--steps", "100"], 10)),
    (["doctor", "--steps", "10", "--", "train.py", "--steps", "100"], (["--steps", "100"], 10)),
    (["doctor", "train.py", "--", "--lr", "1", "--", "--json", "x"], (["--lr", "1", "--", "--json", "x"], 30)),
])
def test_the_script_s_options_after_a_double_dash_draw_no_warning(
        argv: list[str], expected: tuple[list[str], int], capsys: pytest.CaptureFixture[str]) -> None:
    assert script_args(argv) == expected
    assert WARNING not in capsys.readouterr().err


def test_doctor_options_after_the_script_still_warn_or_apply(capsys: pytest.CaptureFixture[str]) -> None:
    assert script_args(["doctor", "train.py", "--steps", "100"]) == (["--steps", "100"], 30)
    assert "warning: --steps after the script go to the script" in capsys.readouterr().err
    assert script_args(["doctor", "train.py", "--steps", "50", "--", "--lr", "1"]) == (["--lr", "1"], 50)
    assert WARNING not in capsys.readouterr().err
