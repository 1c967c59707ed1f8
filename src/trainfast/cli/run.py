"""`trainfast run --apply REPORT`: run an unmodified training script to its end with the fixes a doctor report
verified injected (DataLoader arguments, threads, ...): for settings that sit inside a framework the user does not
edit. The library half is `trainfast.diagnose.run.apply`; this module is the command line around it."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from trainfast.decide import FASTER
from trainfast.launch import launch_env

if TYPE_CHECKING:
    from trainfast.diagnose.run.apply import NothingToApply

BAD_INPUT = 2

EXAMPLES = """examples:
  trainfast doctor --verify --json report.json train.py -- data/   # first: re-run the script once per fix
  trainfast run --apply report.json train.py -- data/              # then: run it with the fixes verified faster
  trainfast run --apply report.json --fix num_workers train.py -- data/   # only this fix (verified or not)
  trainfast run --apply report.json -m mypkg.train -- --epochs 1   # a module, as with python -m
  torchrun --nproc-per-node 2 -m trainfast run --apply report.json train.py   # each rank, the same fixes

The script runs unmodified and to its end, in this process as __main__ (as `python train.py ARGS` would: its own
sys.argv, its folder first on sys.path; with -m the current folder), with none of the doctor's hooks.
Without --fix, the fixes applied are those `trainfast doctor --verify` decided faster (by at least {faster}x, beyond
the runs' noise) that train the same (their loss within the baselines' spread, and not known to change what the
model sees) and can be injected (their `overrides` in the JSON report); with --fix, exactly the ones named, each in
the report with overrides (one not verified faster, or that trains differently, gets a warning line saying so).
Where two fixes set one setting differently, the one ranked higher in the report wins, and a note says so.
What is applied is said once on stderr before the script starts (rank 0 only under torchrun; -q leaves it out),
and what happened to the fixes (a compile that fell back, ...) after it ends; the script's stdout stays its own.
Exit code: the script's own (sys.exit(n): n; an exception: 1, with its traceback; Ctrl-C: 130); 2 before the
script starts for a report that cannot be read, a --fix that is not in it, no fix to apply, or an override this
trainfast does not know.
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("run", help="run a training script with the fixes a doctor report verified",
                       description="Run an unmodified training script to its end with the fixes `trainfast doctor "
                                   "--verify` measured faster injected into it.",
                       epilog=EXAMPLES.replace("{faster}", f"{FASTER:g}"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--apply", type=Path, required=True, metavar="REPORT",
                   help="a `trainfast doctor --verify --json` report: its fixes verified faster that train the same "
                        "are applied")
    p.add_argument("--fix", action="append", default=None, metavar="ID",
                   help="apply this fix of the report (repeat for more) instead of the verified ones")
    p.add_argument("-m", dest="module", default=None, metavar="MODULE", help="run a module instead of a script")
    p.add_argument("target", nargs="?", default=None, metavar="SCRIPT", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="-- ARGS", help="arguments for the script")
    p.set_defaults(run=run, command_parser=p)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from trainfast.diagnose.run.apply import (
        ApplyError,
        NothingToApply,
        describe,
        fixes_to_apply,
        load_report,
        run_applied,
    )

    script_args = list(args.script_args)
    if args.module:
        if args.target is not None:  # `-m mod -- a b`: argparse took `a` for SCRIPT
            script_args.insert(0, args.target)
        target = args.module
    elif args.target is None:
        parser.error("give a SCRIPT to run, or -m MODULE")
    else:
        target = args.target
    if not args.module and not Path(target).is_file():
        parser.error(f"no script at {target!r}; give a Python file, or -m MODULE for a module")
    try:
        report = load_report(args.apply)
    except ApplyError as e:  # its message names the file
        return _error(parser, str(e))
    try:
        selection = fixes_to_apply(report, args.fix)
    except NothingToApply as e:
        return _error(parser, f"{args.apply}: {_nothing(e, args, target, script_args)}")
    except ValueError as e:  # ApplyError, or an override this trainfast does not know (a report from a newer one)
        return _error(parser, f"{args.apply}: {e}")
    main = _is_main()
    if main:
        if not getattr(args, "quiet", False):
            _say(describe(selection, str(args.apply)))
            for note in selection.notes:
                _say(f"note: {note}")
        for warning in selection.warnings:
            _say(f"warning: {warning}")
    result = run_applied(target, module=bool(args.module), args=script_args, overrides=selection.overrides)
    if main:
        for event in result.events:
            _say(event)
    return result.exit_code


def _nothing(error: NothingToApply, args: argparse.Namespace, target: str, script_args: list[str]) -> str:
    """Why nothing can be applied, with the commands that would give something: the doctor's --verify run of this
    very script where the report has no verified fix, --fix naming one that can be applied."""
    message = error.why
    if not error.verified and error.applicable:
        script = ["-m", target] if args.module else [target]
        command = shlex.join(["trainfast", "doctor", "--verify", "--json", str(args.apply), *script,
                              *(["--", *script_args] if script_args else [])])
        message += f"; measure the fixes first: {command}"
    if error.applicable:
        message += f"; or apply one anyway with --fix ID (one of: {', '.join(error.applicable)})"
    return message


def _error(parser: argparse.ArgumentParser, message: str) -> int:
    """One line on stderr, as `trainfast <command>: error:` says every bad input; exit 2."""
    print(f"{parser.prog}: error: {message}", file=sys.stderr, flush=True)
    return BAD_INPUT


def _say(line: str) -> None:
    """On stderr: stdout is the script's."""
    print(f"trainfast run: {line}", file=sys.stderr, flush=True)


def _is_main() -> bool:
    """Rank 0, or a process on its own: the one that says what is applied (every rank applies it). A malformed
    launch environment counts as rank 0: the script itself will say what is wrong with it."""
    try:
        return launch_env().is_main
    except ValueError:
        return True
