"""`trainfast doctor`: run an unmodified training script under instrumentation and say what limits it."""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from trainfast.atomic import OutputWriteError, json_text, write_output
from trainfast.cli.flags import positive_int, positive_seconds

# The doctor's wall-time limit when --max-seconds is not given, except for a whole run (which runs to its end)
DEFAULT_MAX_SECONDS = 300.0

if TYPE_CHECKING:
    from trainfast.diagnose.run import DoctorRun


EXAMPLES = """examples:
  trainfast doctor train.py                          # measure 30 steps after 5 warm-up steps, then stop it
  trainfast doctor --steps 100 train.py -- --lr 0.1  # arguments after -- go to the script
  trainfast doctor -m mypkg.train -- --epochs 1      # a module, as with python -m
  trainfast doctor --json report.json --html report.html train.py
  trainfast doctor --max-seconds 120 train.py        # stop the script after 2 minutes, report what it measured
  trainfast doctor --verify train.py -- data/        # re-run the script per fix: measured beside expected gain
  trainfast doctor --whole-run train.py              # to its end (no time limit): start-up, evaluation, goodput
  trainfast doctor --whole-run --tensorboard runs/doctor train.py   # ... and the figures as TensorBoard scalars
  trainfast doctor train.py --steps 50 -- --lr 0.1   # doctor options after SCRIPT too, when -- ends them
  trainfast doctor --verify --patch fixes.diff train.py -- data/   # then: git apply fixes.diff

The script runs unmodified, in this process, as __main__. A step is one training iteration: its optimizer
step(s), or, where no optimizer steps, its backward pass(es).
--verify costs one extra run of the script per fix it can inject, plus two baseline runs (before and after,
so drift shows), each in a fresh process and each as long as a doctor run (up to --max-seconds);
--verify-repeats N does all of that N times and takes the median. The fixes it can inject:
{injectable}.
Under torchrun every rank runs the doctor and all stop at the same step; rank 0 prints the job's one report
(its samples/s summed over the ranks, a row per rank, and the straggler: the rank whose data wait, copies or host
work the others wait for in the all-reduce) and writes --json/--html; --verify is single-process only.
--whole-run lets the script run to its own end (or --max-seconds) with the hooks on, then accounts for every
second of it: start-up (process start to the first training batch), compile, train (the steps, split as above),
evaluation (no-grad forwards of the model in eval mode, their batches), checkpoint (torch.save, safetensors,
torch.distributed.checkpoint writes), epoch_start (iter() to the first batch) and other (printing, sleeping, the
rest); goodput is train's share. The doctor's own work inside the run is left out of the wall time and shown.
Exit code: the script's own when it ends by itself or crashes (the report is printed first), 0 when the
doctor stops it after the measured steps, 2 for bad arguments, 1 when --json/--html could not be written (a
full volume: the report is printed, then why). A script that runs out of memory (CUDA or
CPU) gets a paragraph saying at which step, what the allocator held and what to change (JSON: "oom").
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from trainfast.diagnose.fixes.rule import injectable

    epilog = EXAMPLES.replace("{injectable}", textwrap.fill(", ".join(rule.id for rule in injectable()), 110))
    p = sub.add_parser("doctor", help="measure a training script and say what limits it", epilog=epilog,
                       description="Run an unmodified training script under instrumentation: a verdict with "
                                   "numbers and ranked fixes.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=positive_int, default=30, help="optimizer steps to measure (default: 30)")
    p.add_argument("--warmup", type=int, default=5, help="steps to run before measuring (default: 5)")
    p.add_argument("--max-seconds", type=positive_seconds, default=None, metavar="S",
                   help="stop the script after this much wall time and report what was measured by then "
                        "(default: 300; no limit with --whole-run)")
    p.add_argument("--verify", action="store_true",
                   help="after the run, re-run the script once per fix that can be injected without editing it "
                        "(plus two baseline runs), each in a fresh process, and rank the fixes by measured gain")
    p.add_argument("--verify-repeats", type=positive_int, default=1, metavar="N",
                   help="with --verify: repeat the baseline/fixes/baseline sequence N times and take the median "
                        "(default: 1)")
    p.add_argument("--whole-run", action="store_true",
                   help="let the script run to its end (or --max-seconds) and account for all of its wall time: "
                        "start-up, compilation, training steps, evaluation, checkpoint writes, epoch starts, the rest; "
                        "goodput, throughput over time, drift, and fixes ranked by their gain on the whole run")
    p.add_argument("--tensorboard", type=Path, default=None, metavar="DIR",
                   help="with --whole-run: write the throughput over time, the step's split and the phases to DIR as "
                        "TensorBoard scalars")
    p.add_argument("--patch", type=Path, default=None, metavar="FILE",
                   help="write a unified diff making the loader fixes permanent at the script's own DataLoader call "
                        "(with --verify: those verified 1.03x or faster); paths relative to this folder, for "
                        "`git apply FILE`")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the report as JSON")
    p.add_argument("--html", type=Path, default=None, metavar="PATH", help="write a self-contained HTML report")
    p.add_argument("-m", dest="module", default=None, metavar="MODULE", help="run a module instead of a script")
    p.add_argument("target", nargs="?", default=None, metavar="SCRIPT", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="-- ARGS", help="arguments for the script")
    p.set_defaults(run=run, command_parser=p)
    _keep_arguments(p)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from trainfast.diagnose.run import run_doctor
    from trainfast.diagnose.show.html import render_html

    script_args = list(args.script_args)
    if args.module:
        if args.target is not None:  # `-m mod -- a b`: argparse took `a` for SCRIPT
            script_args.insert(0, args.target)
        target = args.module
    elif args.target is None:
        parser.error("give a SCRIPT to run, or -m MODULE")
    else:
        target = args.target
    script_args = _doctor_options_after_script(script_args, args, parser, getattr(args, "doctor_argv", None))
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup} is not valid; use 0 or more steps")
    if not args.module and not Path(target).is_file():
        parser.error(f"no script at {target!r}; give a Python file, or -m MODULE for a module")
    if args.verify:
        from trainfast.diagnose.report.verify import torchrun_refusal

        refusal = torchrun_refusal(target, module=bool(args.module))
        if refusal is not None:  # before the script runs: nothing to measure twice
            parser.error(refusal)
    if args.max_seconds is None:  # a whole run runs to its end unless given a limit
        args.max_seconds = None if args.whole_run else DEFAULT_MAX_SECONDS
    if args.tensorboard is not None:
        from trainfast.tensorboard import TensorBoardUnavailableError, require_tensorboard

        if not args.whole_run:
            parser.error(f"--tensorboard {args.tensorboard} writes a whole run's figures: add --whole-run")
        try:
            require_tensorboard()
        except TensorBoardUnavailableError as e:  # before the script runs, not after
            parser.error(str(e))
    result = run_doctor(target, module=bool(args.module), args=script_args, steps=args.steps, warmup=args.warmup,
                        max_seconds=args.max_seconds, whole_run=args.whole_run, from_process_start=_own_process(),
                        verify=args.verify, verify_repeats=args.verify_repeats, progress=_say)
    if result.rank != 0:
        return _other_rank(result, args)
    console = Console(stderr=False)
    console.print()  # off the script's last line, which a progress bar may have left open ("\r", no newline)
    result.report.render(console)
    # A full volume (or a folder that refuses writes) costs the file, not the report printed above: one line, exit 1
    written = True
    for path, what in ((args.json, "JSON report"), (args.html, "HTML report")):
        if path is None:
            continue
        payload = result.report.to_json()
        text = json_text(payload) if what == "JSON report" else render_html(payload)
        try:  # atomically: never a torn file
            write_output(path, text, what=f"the {what}", outcome="The report above is complete; only this file is "
                         "missing")
        except OutputWriteError as e:
            if getattr(args, "debug", False):
                raise
            print(f"{parser.prog}: error: {e}", file=sys.stderr, flush=True)
            written = False
        else:
            console.print(f"{what}: {path}")
    if args.patch is not None:
        written = _patch(result.report.to_json(), args.patch, console, parser, args) and written
    if args.tensorboard is not None and result.report.whole_run is not None:
        written = _tensorboard(result.report.whole_run, args.tensorboard, console, parser) and written
    if result.error:
        print(result.error, file=sys.stderr, end="")
    return result.exit_code if written else result.exit_code or 1


def _tensorboard(whole: dict[str, Any], folder: Path, console: Console, parser: argparse.ArgumentParser) -> bool:
    """The whole run's throughput over time, step split and phases as TensorBoard scalars in `folder`."""
    from trainfast.diagnose.show.scalars import scalars
    from trainfast.tensorboard import ScalarWriter

    try:
        with ScalarWriter(folder) as writer:
            for step, values in scalars(whole):
                writer.scalars(step, values)
    except OSError as e:
        print(f"{parser.prog}: error: the TensorBoard events could not be written to {folder}: {e}. The report "
              "above is complete; only these files are missing", file=sys.stderr, flush=True)
        return False
    console.print(f"TensorBoard scalars: {folder} (tensorboard --logdir {folder})")
    return True


def _patch(report: dict[str, Any], path: Path, console: Console, parser: argparse.ArgumentParser,
           args: argparse.Namespace) -> bool:
    """The diff of the loader fixes (run/patch.py) written to `path`, and what it changed and left out, said."""
    from rich.markup import escape

    from trainfast.diagnose.run.patch import report_patch

    patch, notes = report_patch(report, root=Path.cwd())
    for line in [*patch.changed, *(f"not patched: {s}" for s in patch.skipped), *(f"note: {n}" for n in notes)]:
        console.print(f"patch: {escape(line)}")
    if not patch.diff:
        console.print(f"patch: nothing to change in the script's own code: {path} not written")
        return True
    try:
        write_output(path, patch.diff, what="the patch", outcome="The report above is complete; only this file is "
                     "missing")  # (bytes as they are: a CRLF file's diff keeps its line endings)
    except OutputWriteError as e:
        if getattr(args, "debug", False):
            raise
        print(f"{parser.prog}: error: {e}", file=sys.stderr, flush=True)
        return False
    console.print(f"patch: {path} (git apply {path})")
    return True


def _own_process() -> bool:
    """This process was started as `trainfast` (or `python -m trainfast`): its start is the run's start (a whole
    run's start-up counts the interpreter and the imports); not when `main()` is called inside another program."""
    path = Path(sys.argv[0])
    return path.name == "trainfast" or (path.name == "__main__.py" and path.parent.name == "trainfast")


def _other_rank(result: DoctorRun, args: argparse.Namespace) -> int:
    """A rank other than 0 of a torchrun job: one line when rank 0 has its figures for the job's report; its own
    report when rank 0 may not (they could not be sent), or when its script failed (torchrun then ends the job,
    rank 0's report with it). Never --json/--html: those are the job's, rank 0's to write."""
    outcome = result.report.script.get("outcome") or "ended"
    if result.published and result.exit_code == 0:
        print(f"trainfast doctor: rank {result.rank} of {result.world_size} measured ({outcome}); rank 0 prints the "
              "job's report", flush=True)
    else:
        console = Console(stderr=False)
        console.print()
        console.print(f"trainfast doctor: the report of rank {result.rank} of {result.world_size} alone"
                      + ("" if result.published else " (its figures could not be sent to rank 0)"))
        result.report.render(console)
        if args.json or args.html:
            console.print(f"rank {result.rank} writes no --json/--html: rank 0 writes the job's")
    if result.error:
        print(result.error, file=sys.stderr, end="")
    return result.exit_code


def _say(line: str) -> None:
    """`--verify`'s progress, on stderr: the report goes to stdout."""
    print(line, file=sys.stderr, flush=True)


def _keep_arguments(parser: argparse.ArgumentParser) -> None:
    """Keep the doctor's own arguments as given on the namespace (`doctor_argv`): argparse drops a `--` that follows
    SCRIPT (SCRIPT's nargs="?" takes it in), after which `SCRIPT -- --steps 100` and `SCRIPT --steps 100` parse
    alike, though only the second puts a doctor option after SCRIPT."""
    parse = parser.parse_known_args

    def parse_known_args(args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        known, extras = parse(args, namespace)
        known.doctor_argv = list(sys.argv[1:] if args is None else args)
        return known, extras
    parser.parse_known_args = parse_known_args  # type: ignore[method-assign, assignment]


def _doctor_options_after_script(script_args: list[str], args: argparse.Namespace,
                                 parser: argparse.ArgumentParser, as_given: Sequence[str] | None = None) -> list[str]:
    """The script's arguments. `SCRIPT --json r.json -- --lr 1`: the doctor's options before the `--` are taken
    (set on `args`) when they all are the doctor's; without a `--`, everything after SCRIPT is the script's, and
    a doctor option among them gets a warning (the script may well have its own `--json`), unless a `--` argparse
    took in (`as_given`, the arguments as given, has more) already marked them all as the script's."""
    if as_given is not None and list(as_given).count("--") > script_args.count("--"):
        return script_args  # `SCRIPT -- --steps 100`, `-m MODULE -- --steps 100`: the script's, as asked
    if "--" not in script_args:
        options = _option_strings(parser)
        known = [a.split("=")[0] for a in script_args if a.split("=")[0] in options]
        if known:
            print(f"trainfast doctor: warning: {', '.join(known)} after the script go to the script; put doctor "
                  f"options before SCRIPT, or end them with -- (SCRIPT --steps 50 -- SCRIPT'S ARGS)", file=sys.stderr)
        return script_args
    cut = script_args.index("--")
    leading, rest = script_args[:cut], script_args[cut + 1:]
    if not leading:
        return rest
    given, unknown = parser.parse_known_args(leading)
    changed = {a.dest: getattr(given, a.dest) for a in parser._actions
               if getattr(given, a.dest, a.default) not in (a.default, [])}  # [] : no script arguments
    if unknown or set(changed) - MEASURING:
        return script_args  # not all the doctor's: the script's, `--` included, as before
    for dest, value in changed.items():
        setattr(args, dest, value)
    return rest


# The doctor's own options that may also come after SCRIPT (before a `--`); -m, -q and --debug may not (a script's
# --debug is its own)
MEASURING = frozenset({"steps", "warmup", "max_seconds", "verify", "verify_repeats", "json", "html", "whole_run",
                       "tensorboard"})


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions if action.dest in MEASURING for option in action.option_strings}
