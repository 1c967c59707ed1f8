"""`trainfast compare BASE NEW`: doctor reports side by side, one or several a side, each change with its interval, and
a regression gate for CI (`--fail-slower PCT`); `--runs N` measures both sides here first. The method is in
trainfast/diagnose/compare/."""

from __future__ import annotations

import argparse
import glob
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from trainfast.atomic import json_text, write_output
from trainfast.cli.flags import positive_int
from trainfast.diagnose.compare.figures import (
    CONFIDENCE,
    MIN_UNITS,
    STARTUP_NOISE,
    WINDOW,
    Change,
    Comparison,
    Gate,
    IncomparableError,
)
from trainfast.diagnose.compare.gate import compare, judge
from trainfast.trainer.config import ConfigError

EXAMPLES = f"""examples:
  trainfast compare base.json new.json                  # side by side: each change with its interval
  trainfast compare --fail-slower 5 base.json new.json  # exit 1 when NEW is over 5 % slower beyond the noise
  trainfast compare --fail-slower 5 'base-*.json' 'new-*.json'  # several reports a side (quote the patterns)
  trainfast compare --runs 3 --fail-slower 5 old_train.py train.py -- --epochs 1  # measure both here, interleaved
  trainfast compare --fail-slower 5 --json cmp.json base.json new.json

a regression gate in CI: keep baseline reports, measure each change the same way on the same runner, compare:
  for i in 1 2 3; do trainfast doctor --steps 100 --json base-$i.json train.py -- --epochs 1; done  # on main
  for i in 1 2 3; do trainfast doctor --steps 100 --json new-$i.json train.py -- --epochs 1; done   # each change
  trainfast compare --fail-slower 5 'base-*.json' 'new-*.json'                                    # exit 1 fails

BASE and NEW are 'trainfast doctor --json' reports of the same script with the same arguments, batch sizes and
world size, on the same machine: window reports (samples/s and each part of the step), or whole-run reports (wall
time per sample, each phase and goodput). Each side is one report, or a quoted glob pattern matching several: runs
of the same code, whose spread between runs enters the interval. "% slower" is NEW's time per sample over
BASE's, less 1 (15 % slower: each sample takes 1.15x as long). Each change has a {CONFIDENCE * 100:.0f} % interval:
with one report a side, from the two runs' own spread (their measured steps, or a whole run's throughput
intervals, resampled, {MIN_UNITS} at least per report); with several, the runs themselves are resampled too, so a
machine that swings between runs widens it.

--runs N measures both sides here: BASE and NEW are then two scripts (or the same one twice), run under
'trainfast doctor --json' N times each, alternately (a drift of the machine falls on both), with the arguments
after --; --whole-run and --steps pass on to the doctor; --keep DIR keeps the reports.

The gate fails only when the interval's edge closest to no change is beyond --fail-slower, and passes when the
interval stays below --fail-slower, or below twice it with a noise (its half-width) of at most --fail-slower.
In between, these runs cannot tell that slowdown from none: a warning says so and the exit code is 0; measure
more runs (several reports a side, --runs), or more steps, on a quieter machine. So does a verdict that rests on a
run other processes slowed (the doctor's "other processes kept N cores busy"): a slowdown of a contended NEW, a
pass against a contended BASE. And so does a whole run's slowdown that would not be beyond --fail-slower with
BASE's start-up, while the start-up grew by {STARTUP_NOISE:.0%} or less: a start-up is one figure per run, and
varies that much from run to run.

Exit codes: 0 not slower by more than --fail-slower beyond the noise (or no --fail-slower, or the gate could not
decide: a warning says why); 1 slower by more than --fail-slower beyond the noise; 2 reports that cannot be
compared (unreadable JSON, not a doctor report, a different script or arguments, different batch sizes or world
size, another machine, a whole run against a window, fewer than {MIN_UNITS} measured steps), each named in one
line.
"""


def percent(text: str) -> float:
    """`--fail-slower`: a percentage above 0 (`5` or `5%`)."""
    try:
        value = float(text.strip().removesuffix("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a percentage above 0, e.g. --fail-slower 5 "
                                         "(NEW may be at most 5 % slower than BASE beyond the noise)") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text} is not valid; give a percentage above 0, e.g. --fail-slower 5 "
                                         "(NEW may be at most 5 % slower than BASE beyond the noise)")
    return value


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("compare", help="doctor reports side by side, and a CI gate on a slowdown",
                       description="Compare 'trainfast doctor --json' reports of the same script, one or several "
                                   "a side: samples/s and each part of the step (a whole run: wall time per sample, "
                                   "phases, goodput), each change with its interval; --fail-slower makes it a gate; "
                                   "--runs N measures both sides here.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", metavar="BASE", help="the baseline: a report (trainfast doctor --json), or a quoted glob "
                                                "pattern of several ('base-*.json'); with --runs, a script")
    p.add_argument("new", metavar="NEW", help="the report(s) to judge against BASE, as BASE; with --runs, a script")
    p.add_argument("--fail-slower", type=percent, default=None, metavar="PCT",
                   help="exit 1 when NEW is slower than BASE by more than PCT %% beyond the noise (samples/s; "
                        "wall time per sample for whole runs)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the comparison as JSON")
    p.add_argument("--runs", type=positive_int, default=None, metavar="N",
                   help="run 'trainfast doctor' N times on each of the scripts BASE and NEW, alternately, and "
                        "compare those reports")
    p.add_argument("--whole-run", action="store_true", help="with --runs: whole-run reports (doctor --whole-run)")
    p.add_argument("--steps", type=positive_int, default=None, metavar="N",
                   help="with --runs: steps each doctor run measures (the doctor's default: 30)")
    p.add_argument("--keep", type=Path, default=None, metavar="DIR", help="with --runs: keep the reports in DIR")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="-- ARGS",
                   help="with --runs: the scripts' arguments")
    p.set_defaults(run=run, command_parser=p)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.json is not None and args.json.is_dir():
        parser.error(f"--json {str(args.json)!r} is a folder; give a file path such as compare.json")
    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    if args.runs is None:
        extra = [flag for flag, given in (("--whole-run", args.whole_run), ("--steps", args.steps is not None),
                                          ("--keep", args.keep is not None), ("script arguments", script_args))
                 if given]
        if extra:
            parser.error(f"{', '.join(extra)} only go with --runs N (measuring both sides here); to compare "
                         "reports, give BASE and NEW alone")
        paths = (reports_of(args.base, "BASE"), reports_of(args.new, "NEW"))
    else:
        paths = measure(args, script_args)
    names = ("BASE", "NEW")
    labels = tuple([f"{name} ({path})" for path in side] for name, side in zip(names, paths, strict=True))
    sides = [[load_report(path, label) for path, label in zip(side, side_labels, strict=True)]
             for side, side_labels in zip(paths, labels, strict=True)]
    try:
        comparison = compare(sides[0], sides[1], names=(_side_name("BASE", paths[0]), _side_name("NEW", paths[1])),
                             run_names=(labels[0], labels[1]))
    except IncomparableError as e:
        raise ConfigError(f"cannot compare {_listed(paths[0])} and {_listed(paths[1])}: {e}") from e
    gate = judge(comparison, args.fail_slower)
    console = Console()
    console.print(render_table(comparison, paths[0], paths[1]))
    for line in comparison.comparable:
        console.print(f"comparable: {line}", markup=False, highlight=False, soft_wrap=True)
    for note in comparison.notes:
        console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    console.print(gate.verdict, markup=False, highlight=False, soft_wrap=True,
                  style=None if gate.decided else "yellow")
    if args.json is not None:
        write_output(args.json, json_text(comparison_json(comparison, gate, paths[0], paths[1])),
                     what="the comparison's JSON", outcome="The comparison above is complete; only this file is "
                                                            "missing")
    return gate.exit_code


def reports_of(pattern: str, side: str) -> list[Path]:
    """The report files a side names: a path, or a glob pattern (sorted); a pattern that matches nothing is a
    ConfigError naming it."""
    path = Path(pattern).expanduser()
    if path.exists() or not glob.has_magic(pattern):
        return [path]
    found = sorted(Path(p) for p in glob.glob(str(path)))
    if not found:
        raise ConfigError(f"{side} pattern {pattern!r} matches no file; give a report's path, or a quoted pattern "
                          "that matches 'trainfast doctor --json' reports, such as 'base-*.json'")
    return found


def measure(args: argparse.Namespace, script_args: list[str]) -> tuple[list[Path], list[Path]]:
    """`--runs N`: each script under 'trainfast doctor --json', N times, alternately; the reports' paths."""
    scripts = (Path(args.base).expanduser(), Path(args.new).expanduser())
    for side, script in zip(("BASE", "NEW"), scripts, strict=True):
        if not script.is_file():
            raise ConfigError(f"--runs measures scripts: {side} {str(script)!r} is not a file; give two training "
                              "scripts (or the same one twice), e.g. trainfast compare --runs 3 old.py new.py")
    folder = args.keep if args.keep is not None else Path(tempfile.mkdtemp(prefix="trainfast-compare-"))
    folder.mkdir(parents=True, exist_ok=True)
    options = [*(["--whole-run"] if args.whole_run else []), *(["--steps", str(args.steps)] if args.steps else [])]
    paths: tuple[list[Path], list[Path]] = ([], [])
    console = Console(stderr=True)
    for i in range(args.runs):
        for which, (side, script) in enumerate(zip(("base", "new"), scripts, strict=True)):
            path = folder / f"{side}-{i + 1}.json"
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "trainfast", "doctor", "--json", str(path), *options,
                                   str(script), *(["--", *script_args] if script_args else [])],
                                  capture_output=True, text=True)
            if not path.exists():
                tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                raise ConfigError(f"the doctor wrote no report for {side.upper()} run {i + 1} ({script}, exit "
                                  f"{done.returncode}): {' / '.join(tail) or 'no output'}")
            paths[which].append(path)
            console.print(f"run {2 * i + which + 1}/{2 * args.runs}: {side.upper()} {script} "
                          f"({time.perf_counter() - started:.1f} s) -> {path}", markup=False, highlight=False)
    return paths


def _side_name(name: str, paths: list[Path]) -> str:
    return f"{name} ({paths[0]})" if len(paths) == 1 else f"{name} ({len(paths)} runs)"


def _listed(paths: list[Path]) -> str:
    return str(paths[0]) if len(paths) == 1 else f"{paths[0]} … ({len(paths)} reports)"


def load_report(path: Path, name: str) -> Any:
    """The JSON in `path`; a file that cannot be read or parsed is a ConfigError naming it and why."""
    try:
        text = path.expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"cannot read {name}: {why}; give the path of a 'trainfast doctor --json' report") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{name} is not valid JSON ({e}); give a 'trainfast doctor --json' report") from e


def comparison_json(comparison: Comparison, gate: Gate, base: list[Path], new: list[Path]) -> dict[str, Any]:
    single = len(base) == len(new) == 1
    return {"base": str(base[0]) if single else [str(p) for p in base],
            "new": str(new[0]) if single else [str(p) for p in new], **comparison.to_json(), "gate": gate.to_json()}


# ------------------------------------------------------------------------------------------------ the table


def render_table(comparison: Comparison, base: list[Path], new: list[Path]) -> Table:
    units = "steps" if comparison.kind == WINDOW else "throughput intervals"
    kind = "window reports" if comparison.kind == WINDOW else "whole-run reports"
    runs = comparison.runs
    caption = (f"change: NEW vs BASE, with its {CONFIDENCE * 100:.0f} % interval from {comparison.units[0]} and "
               f"{comparison.units[1]} {units}")
    if runs != (1, 1):
        spread = ", ".join(f"{side} {pct:.1f} %" for side, pct in zip(("BASE", "NEW"), comparison.run_spread_pct,
                                                                        strict=True) if pct is not None)
        caption += f" in {runs[0]} and {runs[1]} runs, the runs resampled too (their spread: {spread or 'one run'})"
    table = Table(title=f"trainfast compare: {kind}", caption=caption, box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("", no_wrap=True)
    table.add_column(f"BASE\n{_column(base)}", justify="right")
    table.add_column(f"NEW\n{_column(new)}", justify="right")
    table.add_column("change (interval)", justify="right", no_wrap=True)
    for change in comparison.rows:
        table.add_row(_label(change), _value(change, change.base), _value(change, change.new), _change(change))
    return table


def _column(paths: list[Path]) -> str:
    return paths[0].name if len(paths) == 1 else f"{len(paths)} runs (mean)"


def _label(change: Change) -> str:
    if change.unit == "s/step":
        return "step (mean)" if change.name == "step" else f"  {change.name} / step"
    if change.unit == "s":
        return f"phase: {change.name.replace('_', ' ')}"
    return change.name


def _value(change: Change, value: float | None) -> str:
    if value is None:
        return "—"
    if change.unit == "samples/s":
        return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"
    if change.unit == "share":
        return f"{value:.1%}"
    return seconds(value)


def _change(change: Change) -> str:
    if change.unit == "share":  # goodput: in points
        if change.base is None or change.new is None:
            return "—"
        return f"{(change.new - change.base) * 100:+.1f} pts"
    pct = change.change_pct
    if pct is None:
        return f"+{seconds(change.new)}" if change.new else "—"  # from nothing: how much there is now
    if change.interval_pct is None:
        if change.base_share is not None and change.new_share is not None:  # a phase: its share of the wall time
            return f"{_pct(pct)}, share {change.base_share:.0%} → {change.new_share:.0%}"
        return _pct(pct)
    low, high = change.interval_pct
    return f"{_pct(pct)} ({_pct(low, unit=False)} to {_pct(high, unit=False)})"


def _pct(pct: float, *, unit: bool = True) -> str:
    """A % change; from 10x on, as a factor (673x reads better than +67,200 %)."""
    if pct >= 900:
        return f"{pct / 100 + 1:,.0f}x"
    return f"{pct:+.1f}" + (" %" if unit else "")


def seconds(value: float) -> str:
    """A duration in the unit that reads best, about 3 significant digits: 245 s, 12.3 s, 45.6 ms, 7.89 µs."""
    if value <= 0:
        return "0"
    scale, unit = next(((s, u) for s, u in ((1.0, "s"), (1e-3, "ms")) if value >= 0.9995 * s), (1e-6, "µs"))
    x = value / scale
    return f"{x:,.0f} {unit}" if x >= 99.95 else f"{x:.1f} {unit}" if x >= 9.995 else f"{x:.2f} {unit}"
