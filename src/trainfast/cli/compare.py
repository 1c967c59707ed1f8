"""`trainfast compare BASE NEW`: two doctor reports side by side, each change with its interval, and a regression gate
for CI (`--fail-slower PCT`). The method is in trainfast/diagnose/compare.py."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from trainfast.atomic import json_text, write_output
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
  trainfast compare --fail-slower 5 --json cmp.json base.json new.json

a regression gate in CI: keep a baseline report, measure each change the same way on the same runner, compare:
  trainfast doctor --steps 100 --json base.json train.py -- --epochs 1   # once, on the main branch; keep it
  trainfast doctor --steps 100 --json new.json train.py -- --epochs 1    # on each change
  trainfast compare --fail-slower 5 base.json new.json                   # exit 1 fails the job

BASE and NEW are 'trainfast doctor --json' reports of the same script with the same arguments, batch sizes and
world size: two window reports (samples/s and each part of the step), or two whole-run reports (wall time per
sample, each phase and goodput). "% slower" is NEW's time per sample over BASE's, less 1 (15 % slower: each
sample takes 1.15x as long). Each change has a {CONFIDENCE * 100:.0f} % interval from the two runs' own spread:
their measured steps (a whole run's throughput intervals) resampled, {MIN_UNITS} at least per report.

The gate fails only when the interval's edge closest to no change is beyond --fail-slower, and passes when the
interval stays below --fail-slower, or below twice it with a noise (its half-width) of at most --fail-slower.
In between, these two runs cannot tell that slowdown from none: a warning says so and the exit code is 0; measure
more steps (--steps), on a quieter machine. So does a verdict that rests on a run other processes slowed (the
doctor's "other processes kept N cores busy"): a slowdown of a contended NEW, a pass against a contended BASE.
And so does a whole run's slowdown that would not be beyond --fail-slower with BASE's start-up, while the
start-up grew by {STARTUP_NOISE:.0%} or less: a start-up is one figure per run, and varies that much from run to
run. The interval covers the noise within each run, not a change of machine
between them: the notes name what else the reports record of that (another torch, CPU count or GPU).

Exit codes: 0 not slower by more than --fail-slower beyond the noise (or no --fail-slower, or the gate could not
decide: a warning says why); 1 slower by more than --fail-slower beyond the noise; 2 reports that cannot be
compared (unreadable JSON, not a doctor report, a different script or arguments, different batch sizes or world
size, a whole run against a window, fewer than {MIN_UNITS} measured steps), each named in one line.
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
    p = sub.add_parser("compare", help="two doctor reports side by side, and a CI gate on a slowdown",
                       description="Compare two 'trainfast doctor --json' reports of the same script: samples/s "
                                   "and each part of the step (a whole run: wall time per sample, phases, "
                                   "goodput), each change with its interval; --fail-slower makes it a gate.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", type=Path, metavar="BASE", help="the baseline report (trainfast doctor --json)")
    p.add_argument("new", type=Path, metavar="NEW", help="the report to judge against BASE")
    p.add_argument("--fail-slower", type=percent, default=None, metavar="PCT",
                   help="exit 1 when NEW is slower than BASE by more than PCT %% beyond the noise (samples/s; "
                        "wall time per sample for whole runs)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the comparison as JSON")
    p.set_defaults(run=run, command_parser=p)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.json is not None and args.json.is_dir():
        parser.error(f"--json {str(args.json)!r} is a folder; give a file path such as compare.json")
    names = (f"BASE ({args.base})", f"NEW ({args.new})")
    reports = [load_report(path, name) for path, name in zip((args.base, args.new), names, strict=True)]
    try:
        comparison = compare(*reports, names=names)
    except IncomparableError as e:
        raise ConfigError(f"cannot compare {args.base} and {args.new}: {e}") from e
    gate = judge(comparison, args.fail_slower)
    console = Console()
    console.print(render_table(comparison, args.base, args.new))
    for note in comparison.notes:
        console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    console.print(gate.verdict, markup=False, highlight=False, soft_wrap=True,
                  style=None if gate.decided else "yellow")
    if args.json is not None:
        write_output(args.json, json_text(comparison_json(comparison, gate, args.base, args.new)),
                     what="the comparison's JSON", outcome="The comparison above is complete; only this file is "
                                                            "missing")
    return gate.exit_code


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


def comparison_json(comparison: Comparison, gate: Gate, base: Path, new: Path) -> dict[str, Any]:
    return {"base": str(base), "new": str(new), **comparison.to_json(), "gate": gate.to_json()}


# ------------------------------------------------------------------------------------------------ the table


def render_table(comparison: Comparison, base: Path, new: Path) -> Table:
    units = "steps" if comparison.kind == WINDOW else "throughput intervals"
    kind = "window reports" if comparison.kind == WINDOW else "whole-run reports"
    caption = (f"change: NEW vs BASE, with its {CONFIDENCE * 100:.0f} % interval from {comparison.units[0]} and "
               f"{comparison.units[1]} {units}")
    table = Table(title=f"trainfast compare: {kind}", caption=caption, box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("", no_wrap=True)
    table.add_column(f"BASE\n{base.name}", justify="right")
    table.add_column(f"NEW\n{new.name}", justify="right")
    table.add_column("change (interval)", justify="right", no_wrap=True)
    for change in comparison.rows:
        table.add_row(_label(change), _value(change, change.base), _value(change, change.new), _change(change))
    return table


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
