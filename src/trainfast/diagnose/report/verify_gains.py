"""What `--verify`'s runs (report/verify.py) say of one fix, or of the set: is it faster (decide.py's `decide`, the one
home of that question: the fix's samples/s against the mean of the same repeat's baselines, one pair a repeat, with
the baselines before and after as the pairs of a setting against itself, `null_pairs`), and does it train the same
(records/losses.py's `trains_same`: its loss against the baselines' over the same steps). The gain's JSON
(`verify.gains.<fix>`, docs/json-report.md) and the words the progress, the terminal and the HTML page print.

A fix is kept (the set, `trainfast run --apply`) only when decided faster and not known to train differently: its
loss departs from the baselines', or the rule that proposed it knows it changes what the model sees
(`Recommendation.changes_training`: loader workers that never see what the loop sets on the dataset)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from trainfast.decide import Decision, decide
from trainfast.diagnose.records.losses import LossCheck, LossTrace, tail, trains_same

BASELINE = "baseline"

Pair = tuple[float, float]  # (the baselines' mean samples/s, the fix's), one repeat


def decision_of(pairs: Sequence[Pair], nulls: Sequence[Pair]) -> Decision | None:
    """The fix against the baselines (module doc), None without a pair."""
    if not pairs:
        return None
    return decide([a for a, _ in pairs], [b for _, b in pairs], null_pairs=nulls)


def gain_entry(pairs: Sequence[Pair], nulls: Sequence[Pair], error: str | None = None) -> dict[str, Any]:
    """A fix's (or the set's) `verify.gains` entry: the ratios' median and range over the repeats (`median`, `min`,
    `max`, `measured_repeats`, `error`) and the `decision`; the loss keys are `trains_entry`'s."""
    values = [b / a for a, b in pairs]
    decision = decision_of(pairs, nulls)
    return {"median": statistics.median(values) if values else None, "min": min(values, default=None),
            "max": max(values, default=None), "measured_repeats": len(values), "error": None if values else error,
            "decision": decision.to_json() if decision is not None else None}


def _trace(run: Mapping[str, Any]) -> LossTrace:
    steps = run.get("loss_steps")
    return LossTrace(run.get("loss_from"), tuple(run.get("losses") or ()),
                     (int(steps[0]), int(steps[1])) if steps else None, run.get("loss_unseen"))


def loss_check(fix_runs: Sequence[Mapping[str, Any]], base_runs: Sequence[Mapping[str, Any]]) -> LossCheck:
    """The fix's runs' loss against the baselines' (records/losses.py), over the second half of the first
    baseline's compared steps; `same` None, with the reason, where a loss is missing."""
    bases = [run for run in base_runs if not run.get("error")]
    fixed = [run for run in fix_runs if not run.get("error")]
    window = next((tail(trace.steps) for trace in map(_trace, bases) if trace.steps), None)
    if window is None:
        why = next((run["loss_unseen"] for run in bases if run.get("loss_unseen")), "no baseline run measured")
        return LossCheck(None, reason=f"loss not seen: {why}")
    base = [over for over in (_trace(run).over(window) for run in bases) if over is not None]
    fix = [over for over in (_trace(run).over(window) for run in fixed) if over is not None]
    if not fix:
        why = next((run["loss_unseen"] for run in fixed if run.get("loss_unseen")),
                   f"none over steps {window[0]}-{window[1]}")
        return LossCheck(None, steps=window, reason=f"loss not seen with the fix: {why}")
    return trains_same(statistics.fmean(f[0] for f in fix), [b[0] for b in base], [b[1] for b in base],
                       steps=window)


def trains_entry(check: LossCheck, caveat: str | None) -> dict[str, Any]:
    """The gain's loss keys: `trains_same` (False where the loss departs or `caveat`, the proposing rule's
    `changes_training`, says it trains differently; None where no loss was seen), `trains_differently` (why, in
    words), `loss` (the check)."""
    why = [w for w in (check.said() if check.same is False else None, caveat) if w]
    same = False if why else check.same
    return {"trains_same": same, "trains_differently": "; ".join(why) or None, "loss": check.to_json()}


def kept(gain: Mapping[str, Any]) -> bool:
    """Decided faster and not known to train differently: what the set and `run --apply` take."""
    decision = gain.get("decision") or {}
    return decision.get("verdict") == "faster" and gain.get("trains_same") is not False


def gain_line(fix_id: str, gain: Mapping[str, Any]) -> str:
    """A fix's result in a line (the progress's): the decision in words, then how it trains."""
    if gain.get("decision") is None:
        return f"{fix_id} not measured: {gain.get('error') or 'no result'}"
    decision = Decision(**gain["decision"])
    differs = gain.get("trains_differently")
    if decision.faster and differs:
        return f"{fix_id} is faster ({decision.interval()}), but trains differently: {differs}"
    line = decision.said("the baseline", fix_id)
    if differs:
        return f"{line}; and it trains differently: {differs}"
    loss = LossCheck(**{**gain["loss"], "steps": tuple(gain["loss"]["steps"]) if gain["loss"]["steps"] else None}) \
        if gain.get("loss") else None
    if loss is not None and loss.same is None:
        return f"{line}; {loss.reason}"
    return line + ("; trains the same: " + loss.said() if loss is not None and loss.same else "")


def verified_cell(gain: Mapping[str, Any] | None) -> list[str]:
    """The terminal's and the HTML's "verified" cell, a line each: the ratio, its interval, the verdict, and how it
    trains (`cannot tell` is an answer, with the pairs that would tell)."""
    if not gain or not isinstance(gain.get("decision"), Mapping):
        return []
    try:
        d = Decision(**gain["decision"])
    except TypeError:  # a report from another trainfast: no cell rather than a broken page
        return []
    verdict = {"faster": "faster", "slower": "slower", "same": f"within {d.threshold:g}x",
               "inconclusive": "cannot tell" + (f" (~{d.pairs_needed} pairs would)" if d.pairs_needed else "")}
    lines = [f"{d.ratio:.2f}x", f"{d.low:.2f}-{d.high:.2f}x", verdict[d.verdict]]
    if gain.get("trains_same") is False:
        lines.append("trains differently")
    elif gain.get("trains_same") is None and gain.get("loss"):
        lines.append("loss not seen")
    return lines
