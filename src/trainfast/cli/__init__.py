"""`trainfast <command>`: a thin argparse front; each command lives in its own module.

`main` is also where trainfast's own expected failures become one line on stderr,
`trainfast <command>: error: <message>`, instead of a traceback: exit 2 for input that cannot work (a config
value, a checkpoint to resume from, a dataset smaller than one batch), 1 for a failure during the work (a
non-finite loss, out of memory, no room for a checkpoint or a report file, a corrupt image, a loader failure,
remote storage that stays unreachable).
Any other exception is a bug and keeps its traceback; `--debug` (before or after the command) keeps the traceback
of every error.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from trainfast.atomic import OutputWriteError
from trainfast.bench.plot import PlotUnavailableError
from trainfast.cli import bench, compare, demo, doctor, env, pack, run, train, tune
from trainfast.data.decode import CorruptImageError
from trainfast.data.remote import RemoteStorageError, RemoteSupportMissing
from trainfast.launch import launch_env
from trainfast.loader.faults import LoaderError
from trainfast.trainer.checkpoint import CheckpointError, CheckpointWriteError
from trainfast.trainer.config import ConfigError
from trainfast.trainer.loop import NonFiniteLossError, TrainingOutOfMemoryError
from trainfast.tune.batch_size import BatchSizeError
from trainfast.version import __version__

COMMANDS = (train, pack, demo, doctor, run, compare, tune, bench, env)
BAD_INPUT, FAILED = 2, 1
# trainfast's own expected failures and their exit codes, most specific first: 2 for what the user gave, 1 for
# what went wrong during the work. Anything else is a bug and keeps its traceback.
EXPECTED: tuple[tuple[type[Exception], int], ...] = (
    (CheckpointWriteError, FAILED),  # before CheckpointError, its base: the disk filled up (or the like)
    (CheckpointError, BAD_INPUT),  # the checkpoint to resume from is missing, corrupt or does not fit
    (ConfigError, BAD_INPUT),
    (PlotUnavailableError, BAD_INPUT),
    (NonFiniteLossError, FAILED),
    (TrainingOutOfMemoryError, FAILED),
    (BatchSizeError, FAILED),
    (CorruptImageError, FAILED),
    (LoaderError, FAILED),
    (RemoteStorageError, FAILED),  # storage that stayed unreachable, or an object missing from a pack
    (RemoteSupportMissing, BAD_INPUT),  # a URL without the remote extra installed
    (OutputWriteError, FAILED),  # a report file on a full volume: the work it reports on is done
)
QUIET_HELP = "only warnings and errors on stderr"
DEBUG_HELP = "show the full traceback of an error instead of its one-line message (for bug reports)"
# torch re-raises a DataLoader worker's exception with the worker's formatted traceback as its message
WORKER_TRACEBACK = "Original Traceback (most recent call last):"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainfast", description="Keep the accelerator fed: measure, tune and train PyTorch models fast.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  trainfast demo --quick\n  trainfast train --epochs 2 --checkpoint-dir runs/a\n"
               "  trainfast pack ~/data/pets ~/data/pets-packed --image-size 96\n"
               "  torchrun --standalone --nproc-per-node=2 -m trainfast train --epochs 2\n"
               "  trainfast doctor train.py -- --lr 0.1\n"
               "  trainfast run --apply report.json train.py -- --lr 0.1\n"
               "  trainfast compare --fail-slower 5 base.json new.json\n"
               "  trainfast tune\n  trainfast bench --quick --plot bench.png\n"
               "  trainfast env\n\n"
               "'trainfast <command> --help' shows each command's flags and examples.")
    parser.add_argument("--version", action="version", version=f"trainfast {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help=QUIET_HELP)
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.register(sub)
    for command_parser in sub.choices.values():  # `trainfast train --debug` as well as `trainfast --debug train`
        command_parser.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                                    help=QUIET_HELP)
        command_parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `trainfast <command>`; returns the exit code (argparse's own usage errors raise SystemExit(2))."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.getLogger("trainfast").setLevel(logging.WARNING if args.quiet else logging.INFO)
    try:
        return int(args.run(args, args.command_parser))
    except Exception as e:
        code = next((code for kind, code in EXPECTED if isinstance(e, kind)), None)
        if code is None or args.debug:
            raise
        if not (isinstance(e, CheckpointWriteError) and not _is_main()):
            # every rank raises CheckpointWriteError; rank 0 says it, once
            print(f"{args.command_parser.prog}: error: {error_message(e, args)}", file=sys.stderr, flush=True)
        return code


def _is_main() -> bool:
    """Whether this process is rank 0 (or alone); a malformed launch environment counts as rank 0, so the error
    being reported is still said."""
    try:
        return launch_env().is_main
    except ValueError:
        return True


def error_message(error: Exception, args: argparse.Namespace) -> str:
    """The error's own message (a DataLoader worker's without the worker's traceback), with the command's fix
    where the library's message names none."""
    message = str(error)
    if WORKER_TRACEBACK in message:  # "Caught X in DataLoader worker process N.\nOriginal Traceback ...\nmod.X: msg"
        name = f"{type(error).__module__}.{type(error).__qualname__}: "
        at = message.rfind(name)
        message = (message[at + len(name):] if at >= 0 else message.strip().splitlines()[-1]).strip()
    if isinstance(error, CorruptImageError):
        message += _corrupt_image_hint(args)
    if isinstance(error, RemoteStorageError) and getattr(args, "checkpoint_dir", None):
        last = Path(args.checkpoint_dir) / "last.pt"
        message += (f". {last} is intact: once the storage answers, rerun the same command with --resume"
                    if last.exists() else ". No checkpoint was written yet")
    return message


def _corrupt_image_hint(args: argparse.Namespace) -> str:
    on_bad_sample = getattr(args, "on_bad_sample", None)
    if on_bad_sample == "error":
        return (". Fix or remove the file, or rerun with --on-bad-sample skip to skip corrupt images (each is "
                "logged and replaced by the next image; up to 1% of the samples)")
    if on_bad_sample == "skip":  # "too many" or "no decodable image": the library message names the files
        return (" (--on-bad-sample skip tolerates up to 1% corrupt samples, judged over at least 100: the Python "
                "API's max_bad_fraction=0.01)")
    return ". Fix or remove the file"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
