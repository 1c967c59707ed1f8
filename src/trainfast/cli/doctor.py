"""`trainfast doctor`: run an unmodified training script under instrumentation and say what limits it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from trainfast.atomic import write_json
from trainfast.cli.flags import positive_int

EXAMPLES = """examples:
  trainfast doctor train.py                          # measure 30 steps after 5 warm-up steps, then stop it
  trainfast doctor --steps 100 train.py -- --lr 0.1  # arguments after -- go to the script
  trainfast doctor -m mypkg.train -- --epochs 1      # a module, as with python -m
  trainfast doctor --json report.json --html report.html train.py

The script runs unmodified, in this process, as __main__. A step ends at each optimizer.step().
Exit code: the script's own when it ends by itself or crashes (the report is printed first), 0 when the
doctor stops it after the measured steps, 2 for bad arguments.
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("doctor", help="measure a training script and say what limits it", epilog=EXAMPLES,
                       description="Run an unmodified training script under instrumentation: a verdict with "
                                   "numbers and ranked fixes.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=positive_int, default=30, help="optimizer steps to measure (default: 30)")
    p.add_argument("--warmup", type=int, default=5, help="steps to run before measuring (default: 5)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the report as JSON")
    p.add_argument("--html", type=Path, default=None, metavar="PATH", help="write a self-contained HTML report")
    p.add_argument("-m", dest="module", default=None, metavar="MODULE", help="run a module instead of a script")
    p.add_argument("target", nargs="?", default=None, metavar="SCRIPT", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="-- ARGS", help="arguments for the script")
    p.set_defaults(run=run, command_parser=p)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from trainfast.diagnose.html import render_html
    from trainfast.diagnose.runner import run_doctor

    script_args = list(args.script_args)
    if args.module:
        if args.target is not None:  # `-m mod -- a b`: argparse took `a` for SCRIPT
            script_args.insert(0, args.target)
        target = args.module
    elif args.target is None:
        parser.error("give a SCRIPT to run, or -m MODULE")
    else:
        target = args.target
    if script_args and script_args[0] == "--":
        script_args = script_args[1:]
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup} is not valid; use 0 or more steps")
    if not args.module and not Path(target).is_file():
        parser.error(f"no script at {target!r}; give a Python file, or -m MODULE for a module")
    result = run_doctor(target, module=bool(args.module), args=script_args, steps=args.steps, warmup=args.warmup)
    console = Console(stderr=False)
    result.report.render(console)
    if args.json:
        write_json(args.json, result.report.to_json())
        console.print(f"JSON report: {args.json}")
    if args.html:
        args.html.parent.mkdir(parents=True, exist_ok=True)
        args.html.write_text(render_html(result.report.to_json()))
        console.print(f"HTML report: {args.html}")
    if result.error:
        print(result.error, file=sys.stderr, end="")
    return result.exit_code
