"""What the measurement left out or counted its own way, said in the report's notes (topic "measurement"): steps that
spanned an evaluation pass, a loop that collects between updates, input prepared without a DataLoader, samples that
could not be counted."""

from __future__ import annotations

from trainfast.diagnose.records.capture import TimelineRecord
from trainfast.diagnose.records.findings import Note


def measurement_notes(t: TimelineRecord) -> list[Note]:
    notes = []
    if t.evaluation_steps:
        how = ("batches fetched with gradients off, or by a loader that never fed training" if t.loader_fed else
               "the model called with gradients off before the step's training forward")
        notes.append(Note(f"{t.evaluation_steps} step(s) that spanned an evaluation pass ({how}, the model in eval "
                          "mode) were left out of the step's split; their time counts in samples/s, which is over "
                          "the measured window's wall time", "measurement"))
    if t.cycle is not None:
        span = ("spans whole cycles, from one collection phase to the next" if t.cycle == "whole" else
                "ends mid-cycle: a cycle is longer than the steps measured allow; measure more (--steps) for the "
                "cycle's true rate")
        notes.append(Note("the loop collects between updates (no-grad forwards in training mode before some steps' "
                          "update: an RL rollout, sampling): that phase is booked as its own share, and the measured "
                          f"window {span}", "measurement"))
    if t.input_source == "script":
        notes.append(Note("no DataLoader fed training: data wait is the time from the end of one step to the model's "
                          "first forward (input prepared in the loop), and samples are counted from the model's "
                          "input", "measurement"))
    return notes


def uncounted_samples(t: TimelineRecord) -> list[Note]:
    """Steps were measured, but no sample counted in them."""
    if not t.records or t.samples_per_s is not None:
        return []
    return [Note("samples/s unknown: no tensor with a batch dimension was found in the batches (tuples, lists, dicts "
                 "and dataclasses are searched); the step times stand", "measurement")]
