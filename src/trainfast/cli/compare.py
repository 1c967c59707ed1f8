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
from trainfast.decide import CONFIDENCE as DECISION_CONFIDENCE
from trainfast.decide import STALL, drift_bound, looks_between
from trainfast.diagnose.compare.figures import (
    CONFIDENCE,
    INCONCLUSIVE_CHOICES,
    MIN_UNITS,
    STARTUP_NOISE,
    WINDOW,
    Change,
    Comparison,
    Gate,
    IncomparableError,
)
from trainfast.diagnose.compare.gate import compare
from trainfast.diagnose.compare.judge import judge
from trainfast.trainer.config import ConfigError

# a side, --runs' default budget: a 15 % slowdown at --fail-slower 5 is found in >= 90 % of simulated gates (real
# doctor runs here spread wider and find it less often: BENCHMARKS.md, "The decision")
MAX_RUNS = 12

EXAMPLES = f"""examples:
  trainfast compare base.json new.json                  # side by side: each change with its interval
  trainfast compare --fail-slower 5 'base-*.json' 'new-*.json'  # a gate on several reports a side (quote patterns)
  trainfast compare --runs 3 --fail-slower 5 old_train.py train.py -- --epochs 1  # measure both here, interleaved
  trainfast compare base.json new.json --fail-slower 5 --inconclusive pass --json cmp.json

a regression gate in CI: measure the change and its baseline side by side on the same runner, and let the gate
extend the runs until it can tell (--runs 3 first, up to --max-runs {MAX_RUNS} a side):
  git show main:train.py > old_train.py
  trainfast compare --runs 3 --fail-slower 5 old_train.py train.py -- --epochs 1   # exit 1 fails, 3 cannot tell

BASE and NEW are 'trainfast doctor --json' reports of the same script with the same arguments, batch sizes and
world size, on the same machine: window reports (samples/s and each part of the step), or whole-run reports (wall
time per sample, each phase and goodput). Each side is one report, or a quoted glob pattern matching several: runs
of the same code. With --runs N, BASE and NEW are two scripts (two versions of one, or the same one twice): each is
run under 'trainfast doctor --json', in interleaved pairs (BASE NEW, NEW BASE, ...: a drift of the machine falls on
both), with the arguments after --; they must train the same model shape (FLOPs a step) on the same data (each
loader's dataset and batches an epoch) with the same batch sizes and world size; --whole-run and --steps pass on to
the doctor; --keep DIR keeps the reports.

How it decides (trainfast.decide, the one decision): "% slower" is NEW's time per sample over BASE's, less 1. The
interval ({DECISION_CONFIDENCE:.0%}) is made of the spread *between* runs: the pairs' (--runs), or each side's runs'
(reports). One report a side has no such spread: its interval is the drift adjacent runs of one script can have on
these machines (±{(drift_bound() - 1) * 100:.0f} %), so one report a side is never called slower within that. A run
more than {STALL:.0%} slower than its side's median is set aside as stalled. The gate fails when NEW's slowdown is
beyond --fail-slower and the interval is clear of no change; passes when the interval rules out a slowdown of twice
--fail-slower; otherwise it cannot tell, and says the smallest change these runs could detect and how many runs a
side would tell --fail-slower. With --runs, it measures --runs pairs, then one pair more at a time until it can tell
or reaches --max-runs (the looks share the interval's confidence, so stopping early keeps its error rate). It cannot
tell either when a run the verdict rests on was slowed by other processes (the doctor's "other processes kept N
cores busy"), or when a whole run's slowdown is its start-up alone (grown by {STARTUP_NOISE:.0%} or less: one figure a
run, which varies that much). The parts of the step, phases and goodput keep their {CONFIDENCE * 100:.0f} %
intervals from the runs' own steps ({MIN_UNITS} at least per report): what changed, not whether.

Exit codes: 0 not slower (or no --fail-slower); 1 slower by more than --fail-slower beyond the noise; 2 reports that
cannot be compared (unreadable JSON, not a doctor report, a different script or arguments, different batch sizes,
data, model or world size, another machine, a whole run against a window, fewer than {MIN_UNITS} measured steps, a
run that crashed), each named in one line; 3 cannot tell (--inconclusive pass or fail turns it into 0 or 1, for a CI
that must choose).
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
    _options(p)
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="-- ARGS",
                   help="with --runs: the scripts' arguments, after --; compare's own options may come before it")
    p.set_defaults(run=run, command_parser=p)


def _options(p: argparse.ArgumentParser) -> None:
    """compare's options: on its parser, and on the one that takes them after BASE and NEW (`_options_after`)."""
    p.add_argument("--fail-slower", type=percent, default=None, metavar="PCT",
                   help="exit 1 when NEW is slower than BASE by more than PCT %% beyond the noise (samples/s; "
                        "wall time per sample for whole runs)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the comparison as JSON")
    p.add_argument("--inconclusive", choices=INCONCLUSIVE_CHOICES, default="exit",
                   help="what 'cannot tell' exits with --fail-slower: exit (3, the default), pass (0) or fail (1)")
    p.add_argument("--runs", type=positive_int, default=None, metavar="N",
                   help="run 'trainfast doctor' on each of the scripts BASE and NEW in N interleaved pairs first, "
                        "then one pair more at a time until the gate can tell (up to --max-runs), and compare")
    p.add_argument("--max-runs", type=positive_int, default=None, metavar="M",
                   help=f"with --runs and --fail-slower: the most runs a side (default: {MAX_RUNS}, or --runs if "
                        "larger)")
    p.add_argument("--whole-run", action="store_true", help="with --runs: whole-run reports (doctor --whole-run)")
    p.add_argument("--steps", type=positive_int, default=None, metavar="N",
                   help="with --runs: steps each doctor run measures (the doctor's default: 30)")
    p.add_argument("--keep", type=Path, default=None, metavar="DIR", help="with --runs: keep the reports in DIR")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    script_args = _options_after(args, parser)
    if args.json is not None and args.json.is_dir():
        parser.error(f"--json {str(args.json)!r} is a folder; give a file path such as compare.json")
    if args.runs is None:
        extra = [flag for flag, given in (("--whole-run", args.whole_run), ("--steps", args.steps is not None),
                                          ("--keep", args.keep is not None), ("--max-runs", args.max_runs is not None),
                                          ("script arguments", script_args)) if given]
        if extra:
            parser.error(f"{', '.join(extra)} only go with --runs N (measuring both sides here); to compare "
                         "reports, give BASE and NEW alone")
        paths = (reports_of(args.base, "BASE"), reports_of(args.new, "NEW"))
        sides, labels = _loaded(paths)
        comparison = _compared(sides, labels, paths)
    else:
        if args.max_runs is not None and args.max_runs < args.runs:
            parser.error(f"--max-runs {args.max_runs} is under --runs {args.runs}: give --max-runs {args.runs} or "
                         "more (the most runs a side), or leave it out")
        paths, comparison = measure(args, script_args)
    gate = judge(comparison, args.fail_slower, args.inconclusive)
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


def _options_after(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The scripts' arguments (those after `--`); compare's own options given after BASE and NEW, before any `--`,
    set on `args`, as every other command takes them. Anything else there is refused: a script's arguments go
    after `--`."""
    rest = list(args.script_args)
    cut = rest.index("--") if "--" in rest else len(rest)
    before, after = rest[:cut], rest[cut + 1:]
    if before:
        options = argparse.ArgumentParser(prog=parser.prog, add_help=False)
        _options(options)
        _, unknown = options.parse_known_args(before, namespace=args)
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)} (a script's arguments go after --: trainfast "
                         "compare --runs 3 old.py new.py -- --epochs 1)")
    return after


def _loaded(paths: tuple[list[Path], list[Path]]) -> tuple[list[list[Any]], tuple[list[str], list[str]]]:
    labels = ([f"BASE ({path})" for path in paths[0]], [f"NEW ({path})" for path in paths[1]])
    sides = [[load_report(path, label) for path, label in zip(side, side_labels, strict=True)]
             for side, side_labels in zip(paths, labels, strict=True)]
    return sides, labels


def _compared(sides: list[list[Any]], labels: tuple[list[str], list[str]], paths: tuple[list[Path], list[Path]], *,
              paired: bool = False, looks: int = 1, versions: bool = False) -> Comparison:
    try:
        return compare(sides[0], sides[1], names=(_side_name("BASE", paths[0]), _side_name("NEW", paths[1])),
                       run_names=(labels[0], labels[1]), paired=paired, looks=looks, versions=versions)
    except IncomparableError as e:
        raise ConfigError(f"cannot compare {_listed(paths[0])} and {_listed(paths[1])}: {e}") from e


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


def measure(args: argparse.Namespace, script_args: list[str]) -> tuple[tuple[list[Path], list[Path]], Comparison]:
    """`--runs N`: both scripts under 'trainfast doctor --json' in interleaved pairs (BASE NEW, NEW BASE, ...), N
    pairs, then with --fail-slower one more at a time until the gate can tell or --max-runs; the reports' paths and
    the comparison of them (paired)."""
    scripts = (Path(args.base).expanduser(), Path(args.new).expanduser())
    for side, script in zip(("BASE", "NEW"), scripts, strict=True):
        if not script.is_file():
            raise ConfigError(f"--runs measures scripts: {side} {str(script)!r} is not a file; give two training "
                              "scripts (or the same one twice), e.g. trainfast compare --runs 3 old.py new.py")
    folder = args.keep if args.keep is not None else Path(tempfile.mkdtemp(prefix="trainfast-compare-"))
    folder.mkdir(parents=True, exist_ok=True)
    options = [*(["--whole-run"] if args.whole_run else []), *(["--steps", str(args.steps)] if args.steps else [])]
    budget = max(args.runs, args.max_runs or MAX_RUNS) if args.fail_slower is not None else args.runs
    looks = looks_between(args.runs, budget)
    versions = scripts[0].resolve() != scripts[1].resolve()
    paths: tuple[list[Path], list[Path]] = ([], [])
    console = Console(stderr=True)
    for i in range(budget):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            side = ("base", "new")[which]
            path = folder / f"{side}-{i + 1}.json"
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "trainfast", "doctor", "--json", str(path), *options,
                                   str(scripts[which]), *(["--", *script_args] if script_args else [])],
                                  capture_output=True, text=True)
            if not path.exists():
                tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                raise ConfigError(f"the doctor wrote no report for {side.upper()} run {i + 1} ({scripts[which]}, "
                                  f"exit {done.returncode}): {' / '.join(tail) or 'no output'}")
            paths[which].append(path)
            console.print(f"run {len(paths[0]) + len(paths[1])}/{2 * budget} at most: {side.upper()} "
                          f"{scripts[which]} ({time.perf_counter() - started:.1f} s) -> {path}",
                          markup=False, highlight=False)
        if i + 1 < args.runs:
            continue
        sides, labels = _loaded(paths)
        comparison = _compared(sides, labels, paths, paired=True, looks=looks, versions=versions)
        decided = args.fail_slower is not None and judge(comparison, args.fail_slower).decided
        if args.fail_slower is None or decided or i + 1 == budget:
            ended = "decided" if decided else "its budget (--max-runs)" if args.fail_slower is not None else "--runs"
            console.print(f"{i + 1} pair(s) of runs: {ended}", markup=False, highlight=False)
            return paths, comparison
        console.print(f"{i + 1} pair(s) of runs: cannot tell yet; one pair more", markup=False, highlight=False)
    raise AssertionError("unreachable: the loop returns at its budget")


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
    between = ("one run a side: the drift a run here can have, "
               f"±{(drift_bound() - 1) * 100:.0f} %" if runs == (1, 1) else
               f"the spread between {'the pairs of' if comparison.paired else 'the'} {runs[0]} and {runs[1]} runs")
    caption = (f"change: NEW vs BASE; {comparison.measure.name}: the decision's {DECISION_CONFIDENCE:.0%} interval "
               f"({between});\nthe rest: {CONFIDENCE * 100:.0f} % intervals from {comparison.units[0]} and "
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
