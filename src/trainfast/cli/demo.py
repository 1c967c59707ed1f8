"""`trainfast demo`: train the reference model the naive way and the trainfast way; print both side by side."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from trainfast.atomic import json_text, write_output
from trainfast.bench.demo import FULL, QUICK, run_demo
from trainfast.cli.flags import positive_int

EXAMPLES = """examples:
  trainfast demo --quick                      # about a minute on 2 CPU cores
  trainfast demo --repeats 3 --json demo.json  # median speedup of 3 interleaved pairs, with its range
  trainfast demo --quick --epochs 1           # the speeds sooner (one epoch learns little)

The demo dataset is generated on first use under $TRAINFAST_CACHE (default ~/.cache/trainfast).
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="naive vs trainfast on the demo dataset", epilog=EXAMPLES,
                       description="Train the reference model the naive way and the trainfast way; print both.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small dataset, 3 short epochs")
    p.add_argument("--epochs", type=positive_int, default=None, metavar="N",
                   help=f"epochs of each run (default: {QUICK.epochs} with --quick, {FULL.epochs} without)")
    p.add_argument("--repeats", type=positive_int, default=1, help="interleaved naive/trainfast pairs (default: 1)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the comparison as JSON")
    p.set_defaults(run=run, command_parser=p)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    spec = QUICK if args.quick else FULL
    if args.epochs is not None:
        spec = replace(spec, epochs=args.epochs)
    report = run_demo(spec, repeats=args.repeats)
    if args.json:
        write_output(args.json, json_text(report), what="the demo's JSON",
                     outcome="The demo ran (its table is above); only this file is missing")
    return 0
