"""What the fixes could not offer, said in the report's notes: the candidates measured no faster (the measurement that
kept them out), those the doctor could not time, and, for an input-bound step that no input fix addresses, what
stands in the way."""

from __future__ import annotations

from collections.abc import Sequence

from trainfast.decide import FASTER
from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.fixes.rule import RULES
from trainfast.diagnose.records.findings import Note, Recommendation
from trainfast.diagnose.records.steps import main_loader
from trainfast.diagnose.records.trials import Trial


def not_offered(e: Evidence) -> list[Note]:
    """Notes for the candidates the replay measured and found no faster, the ones the doctor could not time (its own
    step that failed), a replay done in place or not at all, and a whole run's evaluation timed no faster."""
    notes: list[Note] = []
    if e.trials is not None:
        if e.trials.reason:
            # (the job's own steps may still have timed FSDP's setting: capture/comm_trial.py)
            notes.append(Note(f"no candidate fix was timed on a replay of the model: {e.trials.reason}", "fixes"))
        if e.trials.in_place:
            notes.append(Note(f"{e.trials.model} could not be copied, so the candidates were timed on the model "
                              "itself, its gradients, buffers and layout put back after each", "fixes"))
        for key, trial in e.trials.trials.items():
            what = {"amp": "mixed precision", "fp32": "float32", "channels_last": "channels_last",
                    "contiguous": "NCHW"}.get(key, trial.setting)
            if trial.failed:
                notes.append(Note(f"{what} not measured: {trial.reason} (each candidate is timed on its own: this "
                                  "failure stopped no other)", "fixes"))
            elif trial.measured and not trial.faster:
                notes.append(Note(f"{what} not recommended: the model's forward and backward under {trial.setting} "
                                  f"ran {trial.factor:.2f}x as fast as the script's ({trial.spread()}, measured on "
                                  f"its own input; {_verdict(trial)})", "fixes"))
    return notes


def _verdict(trial: Trial) -> str:
    """"decided slower at 0.82x (0.75-0.90x, 96 %, 4 pairs)": a fix must be decided faster, at least FASTER."""
    d = trial.decision
    if d is None:
        return f"a fix must be decided {FASTER:.2f}x or more"
    said = {"slower": "slower", "same": f"within {FASTER:.2f}x", "inconclusive": "cannot tell"}.get(d.verdict,
                                                                                                   d.verdict)
    return f"{said}: {d.interval()}; a fix must be decided {FASTER:.2f}x or more"


def not_offered_on_the_run(e: Evidence) -> list[Note]:
    """A whole run's evaluation, timed under autocast + inference_mode and found no faster (or not measured)."""
    trial = e.run.eval_trial if e.run is not None else None
    if trial is None or (trial.factor is not None and trial.faster):
        return []
    return [Note(f"evaluation under {trial.setting} was timed on the script's model: "
                 + (f"{trial.factor:.2f}x ({trial.spread()}), not faster than fp32 here" if trial.factor
                    else f"not measured: {trial.reason}"), "fixes")]


def unaddressed_input(e: Evidence, recommendations: Sequence[Recommendation]) -> Note | None:
    """Where the step is input-bound and no fix of the input addresses it: why no loader worker fix (the model step
    measured slower on the threads more workers would leave it), else what stands in the way and what is left."""
    probe = e.thread_probe
    if (probe is not None and probe[0] < e.threads and probe[1] > 1
            and not any(r.id == "num_workers" for r in recommendations)):
        return Note(f"more loader workers would not pay here: the model step took {probe[1]:.2f}x as long with "
                    f"{probe[0]} intra-op thread(s), the count that would leave cores for them (measured)", "fixes")
    input_fixes = {rule.id for rule in RULES if rule.acts_on == "input"}
    if e.verdict != "input-bound" or input_fixes & {r.id for r in recommendations}:
        return None
    cheaper = ("make each batch cheaper to produce (decode at the size trained: Pillow's draft() or `trainfast "
               "pack`; pre-process once instead of every epoch; augment on the device)")
    loader = main_loader(e.loaders)
    if loader is None:
        return Note(f"no input-side fix to propose: no DataLoader fed training, so the loop prepares its batches "
                    f"itself between steps; move that work into a DataLoader with workers, or {cheaper}", "fixes")
    if loader.num_workers >= e.cpus - (e.device == "cuda") and not (e.workers is not None and e.workers.wait):
        return Note(f"no input-side fix to propose: loader #{loader.index} already runs {loader.num_workers} "
                    f"worker(s) on {e.cpus} usable CPU(s), so more workers would only share the same cores; {cheaper}",
                    "fixes")
    return Note(f"no input-side fix to propose from what was measured; {cheaper}", "fixes")
