"""Fixes for the time a whole run spends outside its training steps, and every fix ranked by its gain on the whole
run (Amdahl on each phase's measured share of the wall time: `run_fixes`).

- `eval_autocast`: evaluation ran in fp32 while training ran under autocast: the script's own model and first
  evaluation input timed both ways (capture/whole_trials.py `eval_trial`: no_grad in fp32 against inference_mode +
  the training's autocast), the factor applied to the evaluation's compute (its data wait stays);
- `eval_less_often`: evaluation's share halved (an estimate: how often to evaluate is the script's choice);
- `async_checkpoint`: the writes' blocking time, less a copy of their bytes to host memory (timed) that a
  background write still blocks for;
- `startup` (and the model step's `compile`): named with their seconds, no gain claimed.
Persistent workers over a whole run are fixes/input.py's `PersistentWorkers.propose_run`. A step fix's gain (on the
step) becomes 1 / (1 - t + t / g) on the run, t the train phase's share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.evidence.wholerun import RunEvidence
from trainfast.diagnose.fixes.rule import MIN_GAIN, RULES, Rule, named_phase, rank, register
from trainfast.diagnose.records.findings import Recommendation
from trainfast.units import format_bytes

# Evaluation below this share of the run: not worth a fix of its own
MIN_SHARE = 0.03


def amdahl(share: float, factor: float) -> float:
    """The whole run's gain when a part taking `share` of it gets `factor` times faster."""
    return 1.0 / (1.0 - share + share / factor) if factor > 0 else 1.0


def _removed(share: float) -> float:
    """The whole run's gain when a part taking `share` of it goes away."""
    return 1.0 / (1.0 - share) if share < 1 else float("inf")


@register
class EvalAutocast(Rule):
    id = "eval_autocast"
    acts_on = "whole run"
    changes = ("evaluation",)
    summary = "evaluation under inference_mode and the training's autocast, where it ran in fp32 and measured slower"
    injects = ("eval_autocast",)

    def run_trials(self, run: RunEvidence) -> tuple[str, ...]:
        return ("evaluation",) if run.share["evaluation"] >= MIN_SHARE else ()

    def propose_run(self, e: Evidence, run: RunEvidence) -> Recommendation | None:
        trial = run.eval_trial
        if run.share["evaluation"] < MIN_SHARE or trial is None or trial.factor is None or not trial.faster:
            return None  # (measured, not faster: fixes/notes.py says so)
        eval_compute = max(0.0, run.seconds["evaluation"] - run.evaluation_wait_s)
        part = eval_compute / run.wall_s if run.wall_s > 0 else 0.0
        assert isinstance(trial.value, tuple)
        device, dtype = trial.value
        return Recommendation(
            "eval_autocast", f"Evaluate under {trial.setting}",
            f"evaluation took {run.share['evaluation']:.0%} of the run ({run.seconds['evaluation']:.1f} s) in fp32 "
            f"while training ran under autocast; its forward ran {trial.factor:.2f}x as fast under {trial.setting} "
            f"({trial.spread()}, on the script's own model and evaluation batch)",
            f"with torch.inference_mode(), torch.autocast({device!r}, dtype=torch.{dtype}): around the "
            "evaluation forwards",
            amdahl(part, trial.factor), overrides={"eval_autocast": dtype}, gain_basis="measured",
            run_gain=amdahl(part, trial.factor))


@register
class EvalLessOften(Rule):
    id = "eval_less_often"
    acts_on = "whole run"
    changes = ("evaluation",)
    summary = "evaluating less often, or on fewer batches, where evaluation takes 3 % of the run or more"

    def propose_run(self, e: Evidence, run: RunEvidence) -> Recommendation | None:
        if run.share["evaluation"] < MIN_SHARE:
            return None
        return Recommendation(
            "eval_less_often", "Evaluate less often, or on fewer batches",
            f"evaluation took {run.share['evaluation']:.0%} of the run: {run.evaluation_passes} pass(es), "
            f"{run.evaluation_forwards} forward(s), {run.seconds['evaluation']:.1f} s",
            f"evaluate every 2x as many steps, or on half the batches{_own_settings(e.script_args)}",
            _removed(run.share["evaluation"] / 2), gain_basis="estimate",
            run_gain=_removed(run.share["evaluation"] / 2),
            basis_reason="the measured share halved: how often to evaluate is the script's choice")


@register
class AsyncCheckpoint(Rule):
    id = "async_checkpoint"
    acts_on = "whole run"
    changes = ("save",)
    summary = "checkpoints written in the background after a copy to host memory, where the writes stop training"
    injects = ("async_checkpoint",)

    def run_trials(self, run: RunEvidence) -> tuple[str, ...]:
        return ("copy",) if run.checkpoint_blocking_s > 0 else ()

    def propose_run(self, e: Evidence, run: RunEvidence) -> Recommendation | None:
        if run.share["checkpoint"] < MIN_SHARE / 3 or run.checkpoint_blocking_s <= 0:
            return None
        wall, seconds = run.wall_s, run.seconds["checkpoint"]
        written = sum(b or 0 for b in run.blocking_write_bytes)
        copy_s = written / run.bandwidth if run.bandwidth else 0.0
        saved = max(0.0, seconds - copy_s)
        rate = f", {written / 1e6 / run.checkpoint_blocking_s:.0f} MB/s" if written else ""
        gain = wall / (wall - saved) if wall > saved else None
        return Recommendation(
            "async_checkpoint", "Write checkpoints in the background",
            f"{len(run.blocking_write_bytes)} checkpoint write(s) stopped training for {seconds:.1f} s "
            f"({run.share['checkpoint']:.0%} of the run; {format_bytes(written)}{rate}); a copy to host memory of the "
            f"same bytes takes {copy_s:.2f} s here (timed)",
            "torch.distributed.checkpoint.async_save(state, checkpoint_id=...), or copy the state to CPU tensors "
            "and torch.save them in a thread", gain, overrides={"async_checkpoint": True}, gain_basis="measured",
            run_gain=gain)


@register
class Startup(Rule):
    id = "startup"
    acts_on = "whole run"
    summary = "the start-up before the first training batch (imports, building the data and the model), named"

    def propose_run(self, e: Evidence, run: RunEvidence) -> Recommendation | None:
        if run.share["startup"] < MIN_SHARE:
            return None
        return named_phase("startup", "Start-up", f"start-up took {run.seconds['startup']:.1f} s "
                           f"({run.share['startup']:.0%}) before the first training batch: imports, building the data "
                           "and the model (tokenising, indexing files): cache what the script builds each run")


def run_fixes(e: Evidence, run: RunEvidence, step_fixes: Sequence[Recommendation]) -> list[Recommendation]:
    """The step fixes with their whole-run gain and the fixes of the run's phases, ranked by their gain on the run;
    a rule whose whole-run part `replaces_window` drops its step fix when it proposes. Those below `MIN_GAIN` on
    the run are dropped, but for the phases named without a gain."""
    found = [replace(r, run_gain=amdahl(run.share["train"], gain) if (gain := r.measured_gain or r.expected_gain)
                     else None) for r in step_fixes]
    for rule in RULES:
        proposed = rule.propose_run(e, run)
        if proposed is not None:
            if rule.replaces_window:
                found = [r for r in found if r.id != rule.id]
            found.append(proposed)
    named = {"compile", "startup"}
    return rank((r for r in found if r.run_gain is None or r.run_gain >= MIN_GAIN or r.id in named), by_run=True)


# The evaluation settings a script's command line may name: how often it evaluates (in steps), and on how many
# batches; matched on the option's name, dashes and case aside.
EVAL_EVERY = frozenset({"eval_interval", "eval_every", "eval_steps", "eval_freq", "eval_frequency", "val_every",
                        "val_check_interval", "evaluation_steps", "validate_every"})
EVAL_BATCHES = frozenset({"eval_iters", "eval_batches", "val_batches", "limit_val_batches", "eval_samples"})


def _own_settings(args: Sequence[str]) -> str:
    """The script's own evaluation settings, as it was run, doubled (how often) or halved (how many batches): ":
    --eval-every 40 (now 20), or --eval-batches 4 (now 8)"; where its command line names none, what to look for."""
    found = []
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if not eq and i + 1 < len(args):
            value = args[i + 1]
        key = name.lstrip("-").replace("-", "_").lower()
        if not name.startswith("-") or not value.isdigit() or key not in EVAL_EVERY | EVAL_BATCHES:
            continue
        now = int(value)
        new = now * 2 if key in EVAL_EVERY else max(1, now // 2)
        if new != now:  # (one batch cannot be halved)
            found.append(f"{name}{eq or ' '}{new} (now {now})")
    if not found:
        return " (the script's own evaluation interval and batches per evaluation: its command line names neither)"
    return ": " + ", or ".join(found)
