"""`trainfast <command>`: a thin argparse front; each command lives in its own module."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from trainfast import __version__
from trainfast.cli import bench, demo, doctor, env, train, tune

COMMANDS = (train, demo, doctor, tune, bench, env)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainfast", description="Keep the accelerator fed: measure, tune and train PyTorch models fast.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  trainfast demo --quick\n  trainfast train --epochs 2 --checkpoint-dir runs/a\n"
               "  torchrun --standalone --nproc-per-node=2 -m trainfast train --epochs 2\n"
               "  trainfast doctor train.py -- --lr 0.1\n  trainfast tune\n  trainfast bench --quick --plot bench.png\n"
               "  trainfast env\n\n"
               "'trainfast <command> --help' shows each command's flags and examples.")
    parser.add_argument("--version", action="version", version=f"trainfast {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.getLogger("trainfast").setLevel(logging.WARNING if args.quiet else logging.INFO)
    return int(args.run(args, args.command_parser))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
