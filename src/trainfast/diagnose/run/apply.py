"""`trainfast run --apply REPORT`: run a training script to its end with the fixes a doctor report verified.

Some settings sit inside a framework the user does not edit (a trainer that builds the DataLoader, sets the threads,
enters autocast). `doctor --verify` already measured those fixes by injecting them into the unmodified script
(`capture/inject.py`'s `apply_overrides`); this module re-uses that injection for real runs:

- `fixes_to_apply` picks the fixes from the report's JSON: by default each one `--verify` decided faster
  (`verify.gains.<fix>.decision`: trainfast.decide's verdict, at least `FASTER` beyond the runs' noise) that trains
  the same (not `trains_same: false`: its loss departed from the baselines', or it is known to change what the model
  sees) and has something to inject, or exactly the ids asked for (one that trains differently with a warning that
  says so, with both losses). Their overrides are merged in the report's (ranked) order; where two set one key
  differently, the higher-ranked wins and a note says so.
- `run_applied` runs the script as `python script.py` (or `python -m module`) would, in this process as `__main__`,
  inside `apply_overrides`, with none of the doctor's hooks: it is the user's run, not a measurement.

This module imports no torch itself: the injection is imported where a fix is checked or a script runs (the
package around it, `diagnose/run/`, still loads the doctor's stages).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from trainfast.decide import FASTER, Decision

# --verify's verdicts (trainfast.decide), as the line that says why nothing is applied words them
VERDICT_WORDS = {"faster": "faster", "slower": "slower", "same": "no faster", "inconclusive": "cannot tell"}


class ApplyError(ValueError):
    """The report, or the fixes asked for, cannot be applied; the message says why and what to do."""


class NothingToApply(ApplyError):
    """No fix was asked for and none is verified faster. `why` says so; `applicable`: the report's fixes that have
    overrides (what `--fix` may name); `verified`: whether the report holds any verified fix (it was made with
    --verify). The message adds the ways out."""

    def __init__(self, why: str, *, applicable: Sequence[str], verified: bool) -> None:
        self.why, self.applicable, self.verified = why, tuple(applicable), verified
        message = why
        if applicable and not verified:
            message += "; measure the fixes first: trainfast doctor --verify --json REPORT SCRIPT"
        if applicable:
            message += f"; or apply one anyway with --fix ID (one of: {', '.join(applicable)})"
        super().__init__(message)


@dataclass(frozen=True)
class Fix:
    """A fix chosen from the report, as it stands there, with what `--verify` decided of it (`verify.gains`)."""

    id: str
    measured_gain: float | None  # --verify's samples/s with the fix over without it; None: not re-run, or no figure
    overrides: dict[str, Any]
    gain_basis: str  # "verified" after --verify, else "measured" or "estimate"
    verdict: str | None = None  # --verify's decision: "faster", "slower", "same", "inconclusive"; None: none made
    decided: str | None = None  # that decision in words, with its interval
    trains_differently: str | None = None  # why --verify found it trains differently (both losses), or None

    @property
    def verified_faster(self) -> bool:
        """--verify decided it faster (trainfast.decide: at least `FASTER`, beyond the runs' noise)."""
        return self.gain_basis == "verified" and self.verdict == "faster"

    @property
    def kept(self) -> bool:
        """What `run --apply` applies unless told which: verified faster, and not known to train differently."""
        return self.verified_faster and self.trains_differently is None


@dataclass(frozen=True)
class Selection:
    """The fixes to apply in the report's order, their overrides merged (`overrides`, what `apply_overrides` takes),
    `notes` (an override a higher-ranked fix overruled) and `warnings` (a fix named with --fix that is not verified
    faster)."""

    fixes: tuple[Fix, ...]
    overrides: dict[str, Any]
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class AppliedRun:
    """How the script ended: its exit code (as `python script.py` would exit) and what happened to the fixes while
    they were applied (`Injected.events`: a compile that fell back, and the like)."""

    exit_code: int
    events: tuple[str, ...]


def load_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A doctor report's JSON, or ApplyError saying what is wrong with the file (missing, not JSON, no
    `recommendations` list)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ApplyError(f"{path}: no such file; give the JSON report of `trainfast doctor --verify --json`") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ApplyError(f"{path}: cannot be read ({e})") from None
    try:
        report = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApplyError(f"{path}: not JSON ({e}); give the report `trainfast doctor --verify --json` wrote") from None
    if not isinstance(report, dict) or not isinstance(report.get("recommendations"), list):
        raise ApplyError(f"{path}: not a trainfast doctor report (no \"recommendations\" list); give the report "
                         "`trainfast doctor --verify --json` wrote")
    return report


def fixes_to_apply(report: Mapping[str, Any], only: Sequence[str] | None = None) -> Selection:
    """The fixes of `report` (a doctor report's JSON) to apply: with `only`, exactly those ids (each must be a fix
    with overrides; one not verified faster, or that trains differently, gets a warning); without, every fix
    `--verify` decided faster that trains the same and has overrides (`Fix.kept`). ApplyError when the report is
    malformed, an id is not a fix that can be applied, or nothing qualifies (NothingToApply); ValueError naming the
    fix where an override is one this trainfast does not know. `report["verify"]["set"]` (the fixes measured
    together) does not change the choice."""
    fixes = _fixes(report)
    applicable = [fix.id for fix in fixes if fix.overrides]
    if only is None:
        chosen = [fix for fix in fixes if fix.overrides and fix.kept]
        if not chosen:
            raise _nothing(fixes, applicable)
        warnings: list[str] = []
    else:
        by_id = {fix.id: fix for fix in fixes}
        for wanted in only:
            if wanted not in applicable:
                raise ApplyError(_not_applicable(wanted, by_id.get(wanted), applicable))
        named = set(only)
        chosen = [fix for fix in fixes if fix.id in named]  # the report's order: its ranking decides conflicts
        warnings = [_unverified(fix) for fix in chosen if not fix.kept]
    _check(chosen)
    from trainfast.diagnose.capture.inject import merge_overrides  # (torch: where a fix is applied)

    overrides, notes = merge_overrides([(fix.id, fix.overrides) for fix in chosen])
    return Selection(tuple(chosen), overrides, tuple(notes), tuple(warnings))


def describe(selection: Selection, source: str) -> str:
    """The line said before the script starts: `applying 2 verified fix(es) from report.json: num_workers
    (num_workers=4, persistent_workers=True; verified 1.84x), ...`."""
    kind = "verified " if all(fix.kept for fix in selection.fixes) else ""
    parts = [f"{fix.id} ({format_overrides(fix.overrides)}; {_gain(fix)})" for fix in selection.fixes]
    return f"applying {len(selection.fixes)} {kind}fix(es) from {source}: {', '.join(parts)}"


def format_overrides(overrides: Mapping[str, Any]) -> str:
    """`num_workers=4, persistent_workers=True`: as the doctor's report writes a fix's overrides."""
    return ", ".join(f"{key}={value}" for key, value in overrides.items())


def run_applied(target: str, *, module: bool, args: Sequence[str] | None, overrides: Mapping[str, Any]) -> AppliedRun:
    """Run `target` (a script path, or a module name with `module`) to its end inside `apply_overrides(overrides)`,
    as `python target ARGS` (`python -m target ARGS`) would: in this process as `__main__`, its `sys.argv` and
    `sys.path[0]` its own. The exit code is the script's (sys.exit(n): n; sys.exit("message"): 1, the message on
    stderr; an exception: 1, its traceback on stderr as Python prints it; Ctrl-C: 130). The overrides are taken back,
    and `sys.argv`, `sys.path` and `os.environ` put back, however it ends. ValueError (before the script runs) for
    an override this trainfast does not know."""
    from trainfast.diagnose.capture.inject import apply_overrides

    saved_argv, saved_path, saved_env = sys.argv[:], sys.path[:], dict(os.environ)
    events: list[str] = []
    try:
        with apply_overrides(overrides) as injected:
            events = injected.events  # the same list: events added until the context exits count too
            exit_code = _run(target, module=module, args=list(args or []))
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.environ.clear()
        os.environ.update(saved_env)
    return AppliedRun(exit_code, tuple(events))


def _run(target: str, *, module: bool, args: list[str]) -> int:
    """The script run to its end, its end as an exit code (the traceback or message printed as Python would)."""
    from trainfast.diagnose.capture.script import run_as_main

    try:
        run_as_main(target, module=module, args=args)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return int(e.code or 0)
        print(e.code, file=sys.stderr, flush=True)  # as Python prints sys.exit("message") on the way out
        return 1
    except KeyboardInterrupt:
        return 130  # as a shell reports a process ended by SIGINT
    except Exception as e:
        sys.stdout.flush()  # the script's last output before its traceback, as on its own
        print("".join(traceback.format_exception(type(e), e, _script_frames(e.__traceback__))), file=sys.stderr,
              end="", flush=True)
        return 1
    return 0


# The frames above the script's own: this module's, capture/script.py's and runpy's, which Python's traceback of
# `python script.py` does not show (it starts at the script's <module>); runpy's read "<frozen runpy>" where the
# interpreter froze it
_ABOVE = {__file__, os.path.join(os.path.dirname(os.path.dirname(__file__)), "capture", "script.py"),
          runpy.__file__, "<frozen runpy>"}


def _script_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the script's first frame on; None where the error came before the script ran (a syntax
    error, a module that cannot be found): then the error alone is printed, as Python prints it."""
    while tb is not None and tb.tb_frame.f_code.co_filename in _ABOVE:
        tb = tb.tb_next
    return tb


def verified_fixes(report: Mapping[str, Any]) -> list[Fix]:
    """The report's fixes that `run --apply` applies by default (`Fix.kept`), in its order: `--patch` writes the
    same ones."""
    return [fix for fix in _fixes(report) if fix.kept]


def _fixes(report: Mapping[str, Any]) -> list[Fix]:
    entries = report.get("recommendations")
    if not isinstance(entries, list):
        raise ApplyError("not a trainfast doctor report (no \"recommendations\" list)")
    verify = report.get("verify")
    gains = verify.get("gains") if isinstance(verify, Mapping) else None
    fixes = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or not isinstance(entry.get("id"), str):
            raise ApplyError(f"recommendations[{i}] is not a fix (an object with an \"id\"): not a doctor report")
        overrides = entry.get("overrides") or {}
        if not isinstance(overrides, Mapping):
            raise ApplyError(f"fix {entry['id']!r}: its overrides are {overrides!r}, not an object")
        gain = entry.get("measured_gain")
        measured = float(gain) if isinstance(gain, (int, float)) and not isinstance(gain, bool) else None
        gain = gains.get(entry["id"]) if isinstance(gains, Mapping) else None
        fixes.append(Fix(entry["id"], measured, dict(overrides), str(entry.get("gain_basis") or "estimate"),
                         *_decision(gain)))
    return fixes


def _decision(gain: Any) -> tuple[str | None, str | None, str | None]:
    """(verdict, its words, why it trains differently) of a `verify.gains.<fix>` entry; Nones where it has none (a
    report from before --verify decided, or a fix it could not run)."""
    if not isinstance(gain, Mapping) or not isinstance(gain.get("decision"), Mapping):
        return None, None, None
    try:
        decision = Decision(**gain["decision"])
    except TypeError as e:
        raise ApplyError(f"verify.gains has a decision this trainfast cannot read ({e}): re-run trainfast doctor "
                         "--verify with this version") from None
    differs = gain.get("trains_differently") if gain.get("trains_same") is False else None
    return decision.verdict, decision.said("the baseline", "it"), str(differs) if differs else None


def _nothing(fixes: list[Fix], applicable: list[str]) -> NothingToApply:
    verified = [fix for fix in fixes if fix.overrides and fix.gain_basis == "verified"]
    if not applicable:
        why = "no fix in the report can be applied without editing the script (none has overrides)"
    elif not verified:
        why = "the report has no verified fix (it was written without --verify)"
    else:
        gains = "; ".join(f"{fix.id} {_gain(fix)}{_why_not(fix)}" for fix in verified)
        why = f"no verified fix was decided at least {FASTER:g}x as fast and trains the same ({gains})"
    return NothingToApply(why, applicable=applicable, verified=bool(verified))


def _why_not(fix: Fix) -> str:
    """Why a verified fix is not applied by default, after its gain: how it trains, or what was decided."""
    if fix.trains_differently:
        return f": {fix.trains_differently}"
    if fix.verdict is None:
        return " (no decision: a report from an older trainfast)" if fix.measured_gain is not None else ""
    return f" ({VERDICT_WORDS.get(fix.verdict, fix.verdict)})"


def _not_applicable(wanted: str, fix: Fix | None, applicable: list[str]) -> str:
    valid = (f"the fixes that can be applied: {', '.join(applicable)}" if applicable
             else "none of its fixes can be applied")
    if fix is None:
        return f"--fix {wanted} is not a fix in the report; {valid}"
    return f"--fix {wanted} needs an edit to the script (nothing can be injected for it); {valid}"


def _unverified(fix: Fix) -> str:
    if fix.gain_basis != "verified":
        return f"fix {fix.id} was never verified (run `trainfast doctor --verify` to measure it); applied as asked"
    if fix.measured_gain is None:
        return f"fix {fix.id}: its --verify run gave no figure; applied as asked"
    if fix.trains_differently:
        return f"fix {fix.id} trains differently: {fix.trains_differently}; applied as asked"
    if fix.verdict is None:
        return (f"fix {fix.id} measured {fix.measured_gain:.2f}x with --verify, which decided nothing of it (a report "
                "from an older trainfast: re-run trainfast doctor --verify); applied as asked")
    return (f"fix {fix.id} is not decided at least {FASTER:g}x as fast by --verify ({fix.decided}); applied as "
            "asked")


def _gain(fix: Fix) -> str:
    if fix.gain_basis != "verified":
        return "never verified"
    if fix.measured_gain is None:
        return "verified, no figure"
    return (f"{'verified' if fix.kept else 'measured'} {fix.measured_gain:.2f}x"
            + (", trains differently" if fix.trains_differently else ""))


def _check(fixes: Sequence[Fix]) -> None:
    """Every override known to this trainfast (a report from a newer one may hold more), before the script runs."""
    from trainfast.diagnose.capture.inject import check_overrides

    for fix in fixes:
        try:
            check_overrides(fix.overrides)
        except ValueError as e:
            raise ValueError(f"fix {fix.id}: {e}") from None
