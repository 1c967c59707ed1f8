"""A fix is one `Rule`: a registered object with its id, what it acts on, what `--verify` can inject for it, how it
proposes the fix from the evidence (and from the whole run, where it has a whole-run part), and the trials it wants
timed while the script is alive. The rules live in fixes/input.py (the input pipeline), fixes/model.py (the model
step), fixes/collectives.py (communication across ranks) and fixes/run.py (the whole run's phases); `rank` orders
every fix, whatever proposed it: the window's, the whole run's, the verified ones.

Adding a fix: a subclass of `Rule` decorated with `@register` in the module of what it acts on, with its test.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.evidence.wholerun import RunEvidence
from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.records.trials import Trial, TrialRequest

# A fix estimated below this is within the noise of a re-measurement: not worth proposing.
MIN_GAIN = 1.02
# Why an estimate is one, for the fixes no replay can time
VERIFY_IT = "--verify re-runs the script with it"
NEEDS_EDIT = "it needs a change to the script, which the doctor cannot make to time it"
ACTS_ON = ("input", "model step", "collectives", "whole run")


class Rule:
    id: ClassVar[str]  # the fix's stable snake_case id (the JSON's "id")
    acts_on: ClassVar[str]  # one of ACTS_ON
    summary: ClassVar[str]  # what the fix does, in a line (the fix table in docs/)
    # the overrides `--verify` can inject for it without editing the script (capture/inject.py), when it proposes
    injects: ClassVar[tuple[str, ...]] = ()
    # its whole-run proposal replaces its window's (the same fix, measured over the run)
    replaces_window: ClassVar[bool] = False
    # what it changes in the script, as the capture's sites name it (records/capture.py `Site.what`), the first
    # one seen is where the fix is made permanent (fixes/where.py): "loader", "to" (the model's .to()), "model"
    # (its construction), "forward", "evaluation", "autocast", "save"
    changes: ClassVar[tuple[str, ...]] = ()

    def propose(self, e: Evidence) -> Recommendation | None:
        """The fix from the measured steps' evidence, or None where it does not apply."""
        return None

    def propose_run(self, e: Evidence, run: RunEvidence) -> Recommendation | None:
        """Its whole-run part: the fix from the whole run's phases, ranked by its gain on the run, or None."""
        return None

    def trials(self, e: Evidence) -> tuple[TrialRequest, ...]:
        """The candidates it wants timed on the script's own model when the measured steps end (capture/probe.py),
        from the evidence so far."""
        return ()

    def run_trials(self, run: RunEvidence) -> tuple[str, ...]:
        """What it wants timed once a whole run has ended: "evaluation" (capture/whole_trials.py `eval_trial`),
        "copy" (`copy_bandwidth`)."""
        return ()


RULES: list[Rule] = []  # in registration order, which breaks ranking ties


def register(cls: type[Rule]) -> type[Rule]:
    """Add the rule (one instance) to `RULES`; each id is registered once."""
    if cls.acts_on not in ACTS_ON:
        raise ValueError(f"{cls.__name__}.acts_on={cls.acts_on!r}: one of {', '.join(ACTS_ON)}")
    if any(r.id == cls.id for r in RULES):
        raise ValueError(f"a rule for the fix {cls.id!r} is registered already: one rule per fix")
    RULES.append(cls())
    return cls


def rank(recommendations: Iterable[Recommendation], *, by_run: bool = False) -> list[Recommendation]:
    """Every fix in one order: those verified to pay (largest verified gain first); then those whose gain was
    measured in the run; then the estimates (a measurement outranks an estimate), each by its gain (on the whole
    run's wall time when `by_run`, else on the step); then the fixes with no figure; last the ones verified slower
    than the baseline (gain < 1), never first. Stable: ties keep the order given."""
    def key(r: Recommendation) -> tuple[int, float]:
        if r.measured_gain is not None:
            return (0, -r.measured_gain) if r.measured_gain >= 1.0 else (4, -r.measured_gain)
        gain = r.run_gain if by_run else r.expected_gain
        if gain is None:
            return 3, 0.0
        return (1 if r.gain_basis != "estimate" else 2), -gain
    return sorted(recommendations, key=key)


def recommend(e: Evidence) -> list[Recommendation]:
    """Every fix the measured steps' evidence calls for, ranked."""
    return rank(r for rule in RULES if (r := rule.propose(e)) is not None)


def trials_wanted(e: Evidence) -> list[TrialRequest]:
    """The candidates every rule wants timed, from the evidence so far."""
    return [request for rule in RULES for request in rule.trials(e)]


def run_trials_wanted(run: RunEvidence) -> set[str]:
    return {what for rule in RULES for what in rule.run_trials(run)}


def injectable() -> list[Rule]:
    """The rules whose fix `--verify` can inject into the script."""
    return [rule for rule in RULES if rule.injects]


def speedup_of_part(share: float, factor: float) -> float:
    """Whole-step gain when a part taking `share` of the step gets `factor` times faster (Amdahl)."""
    return 1.0 / (1.0 - share + share / factor)


def measured_faster(e: Evidence, key: str) -> tuple[Trial, float] | None:
    """The replay's trial of `key` and the step's gain from it, where it measured faster by at least MIN_GAIN."""
    trial = e.trials.get(key) if e.trials is not None else None
    gain = trial.gain(e.fractions.compute, e.compute_s) if trial is not None and trial.faster else None
    return (trial, gain) if trial is not None and gain is not None and gain >= MIN_GAIN else None


def unprobed(e: Evidence, trial: Trial | None) -> str | None:
    """Why the doctor could not time a candidate it tried (its own step failed, or the model could not be replayed):
    then no assumed gain is given either."""
    if trial is not None and trial.failed:
        return f"the doctor could not time it: {trial.reason}"
    if trial is None and e.trials is not None and e.trials.reason:
        return f"the doctor could not time it: {e.trials.reason}"
    return None


def trial_or_reason(e: Evidence, key: str) -> tuple[Trial | None, str | None]:
    """The replay's trial of a candidate (probe.py), or why there is none."""
    if e.trials is None:
        return None, "no replay of the model was tried"
    trial = e.trials.get(key)
    if trial is None:
        return None, e.trials.reason or "the replay did not try it"
    return trial, trial.reason


def named_phase(fix_id: str, title: str, why: str) -> Recommendation:
    """A phase of a whole run named with its seconds (compilation, start-up): no fix to apply, no gain claimed."""
    return Recommendation(fix_id, title, why, "", None, gain_basis="estimate",
                          basis_reason="named with its measured seconds; what a change saves depends on the script")


def fix_table(rules: Sequence[Rule] | None = None) -> str:
    """The fixes as a Markdown table (docs/reading-a-report.md holds it, and a test holds it to the rules)."""
    lines = ["| id | acts on | what it does | `--verify` injects |", "|---|---|---|---|"]
    for rule in RULES if rules is None else rules:
        injects = ", ".join(f"`{k}`" for k in rule.injects) or "no: it needs a change to the script"
        lines.append(f"| `{rule.id}` | {rule.acts_on} | {rule.summary} | {injects} |")
    return "\n".join(lines) + "\n"
