"""Fixes for the time a whole run spends outside its training steps, ranked with the step fixes by their gain on the
whole run (Amdahl on each phase's measured share of the wall time).

- `eval_autocast`: evaluation ran in fp32 while training ran under autocast: the script's own model and first
  evaluation input timed both ways (`eval_trial`: no_grad in fp32 against inference_mode + the training's autocast),
  the factor applied to the evaluation's compute (its data wait stays);
- `eval_less_often`: evaluation's share halved (an estimate: how often to evaluate is the script's choice);
- `async_checkpoint`: the writes' blocking time, less a copy of their bytes to host memory (timed here) that a
  background write still blocks for;
- `persistent_workers`: every epoch after the first restarts the loader's workers: the measured epoch starts, less
  one first batch each (what a kept worker still takes to deliver it: the step's median data wait);
- `startup` and `compile`: named with their seconds (a compile cache where torch.compile ran), no gain claimed.
A step fix's gain (on the step) becomes 1 / (1 - t + t / g) on the run, t the train phase's share.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from trainfast.diagnose.fixes.rule import MIN_GAIN
from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.records.steps import LoaderStats
from trainfast.diagnose.records.trials import Trial
from trainfast.units import format_bytes

if TYPE_CHECKING:
    pass


# Evaluation below this share of the run: not worth a fix of its own
MIN_SHARE = 0.03


def amdahl(share: float, factor: float) -> float:
    """The whole run's gain when a part taking `share` of it gets `factor` times faster."""
    return 1.0 / (1.0 - share + share / factor) if factor > 0 else 1.0


def _removed(share: float) -> float:
    """The whole run's gain when a part taking `share` of it goes away."""
    return 1.0 / (1.0 - share) if share < 1 else float("inf")


def whole_run_fixes(whole: dict[str, Any], step_fixes: list[Recommendation], *, trial: Trial | None,
                    loaders: list[LoaderStats], step_wait_s: float | None,
                    bandwidth: float | None) -> tuple[list[Recommendation], list[str]]:
    """The step fixes with their whole-run gain, and the fixes for the phases outside the steps, ranked together
    by whole-run gain (those with a gain first, measured before estimates); and notes on what was measured and not
    offered."""
    share = {p["phase"]: p["share"] for p in whole["phases"]}
    seconds = {p["phase"]: p["seconds"] for p in whole["phases"]}
    wall = whole["wall_s"]
    found: list[Recommendation] = []
    notes: list[str] = []
    for r in step_fixes:
        gain = r.measured_gain or r.expected_gain
        found.append(replace(r, run_gain=amdahl(share["train"], gain) if gain else None))
    evaluation = whole["evaluation"]
    if share["evaluation"] >= MIN_SHARE:
        eval_compute = max(0.0, seconds["evaluation"] - evaluation["data_wait_s"])
        if trial is not None and trial.factor is not None and trial.faster:
            part = eval_compute / wall if wall > 0 else 0.0
            device, dtype = trial.value
            found.append(Recommendation(
                "eval_autocast", f"Evaluate under {trial.setting}",
                f"evaluation took {share['evaluation']:.0%} of the run ({seconds['evaluation']:.1f} s) in fp32 while "
                f"training ran under autocast; its forward ran {trial.factor:.2f}x as fast under {trial.setting} "
                f"({trial.spread()}, on the script's own model and evaluation batch)",
                f"with torch.inference_mode(), torch.autocast({device!r}, dtype=torch.{dtype}): around the "
                "evaluation forwards",
                amdahl(part, trial.factor), gain_basis="measured", run_gain=amdahl(part, trial.factor)))
        elif trial is not None:
            notes.append(f"evaluation under {trial.setting} was timed on the script's model: "
                         + (f"{trial.factor:.2f}x ({trial.spread()}), not faster than fp32 here" if trial.factor
                            else f"not measured: {trial.reason}"))
        found.append(Recommendation(
            "eval_less_often", "Evaluate less often, or on fewer batches",
            f"evaluation took {share['evaluation']:.0%} of the run: {evaluation['passes']} pass(es), "
            f"{evaluation['forwards']} forward(s), {seconds['evaluation']:.1f} s",
            "evaluate every 2x as many steps, or on half the batches (nanoGPT: eval_interval x2 or eval_iters / 2)",
            _removed(share["evaluation"] / 2), gain_basis="estimate", run_gain=_removed(share["evaluation"] / 2),
            basis_reason="the measured share halved: how often to evaluate is the script's choice"))
    checkpoint = whole["checkpoint"]
    if share["checkpoint"] >= MIN_SHARE / 3 and checkpoint["blocking_s"] > 0:
        blocking = [w for w in checkpoint["writes"] if not w["background"]]
        written = sum(w["bytes"] or 0 for w in blocking)
        copy_s = written / bandwidth if bandwidth else 0.0
        saved = max(0.0, seconds["checkpoint"] - copy_s)
        rate = f", {written / 1e6 / checkpoint['blocking_s']:.0f} MB/s" if written else ""
        found.append(Recommendation(
            "async_checkpoint", "Write checkpoints in the background",
            f"{len(blocking)} checkpoint write(s) stopped training for {seconds['checkpoint']:.1f} s "
            f"({share['checkpoint']:.0%} of the run; {format_bytes(written)}{rate}); a copy to host memory of the "
            f"same bytes takes {copy_s:.2f} s here (timed)",
            "torch.distributed.checkpoint.async_save(state, checkpoint_id=...), or copy the state to CPU tensors "
            "and torch.save them in a thread", wall / (wall - saved) if wall > saved else None, gain_basis="measured",
            run_gain=wall / (wall - saved) if wall > saved else None))
    restarts = whole["epoch_start"]["seconds"][1:]
    persistent = [s.persistent_workers for s in loaders if s.num_workers and s.batches > s.evaluation_batches]
    if restarts and persistent and not any(persistent) and share["epoch_start"] > 0:
        kept = (step_wait_s or 0.0) * len(restarts)
        saved = max(0.0, sum(restarts) - kept)
        gain = wall / (wall - saved) if wall > saved else None
        if gain is not None and gain >= 1.005:
            found = [r for r in found if r.id != "persistent_workers"]
            found.append(Recommendation(
                "persistent_workers", "Keep the loader's workers alive between epochs",
                f"{len(restarts)} epoch(s) after the first restarted the loader's workers: {sum(restarts):.1f} s "
                f"from iter() to the first batch, against {kept:.2f} s for a first batch from kept workers (the "
                "steps' median data wait)",
                "DataLoader(..., persistent_workers=True)", gain, overrides={"persistent_workers": True},
                gain_basis="measured", run_gain=gain))
    if seconds["compile"] > 0:
        found.append(_note("compile", f"torch.compile took {seconds['compile']:.1f} s ({share['compile']:.0%}) of "
                           "the first steps: a compile cache (TORCHINDUCTOR_FX_GRAPH_CACHE=1, on by default in recent "
                           "torch; torch.compiler.save_cache_artifacts) keeps it for the next run"))
    if share["startup"] >= MIN_SHARE:
        found.append(_note("startup", f"start-up took {seconds['startup']:.1f} s ({share['startup']:.0%}) before "
                           "the first training batch: imports, building the data and the model (tokenising, "
                           "indexing files): cache what the script builds each run"))
    offered = [r for r in found if r.run_gain is None or r.run_gain >= MIN_GAIN or r.id in ("compile", "startup")]
    ranked = sorted(offered, key=lambda r: (r.run_gain is None, r.gain_basis == "estimate", -(r.run_gain or 0.0)))
    return ranked, notes


def _note(fix_id: str, why: str) -> Recommendation:
    """A phase named with its seconds, no gain claimed."""
    return Recommendation(fix_id, {"compile": "Compilation", "startup": "Start-up"}[fix_id], why, "", None,
                          gain_basis="estimate", basis_reason="named with its measured seconds; what a change "
                          "saves depends on the script")
