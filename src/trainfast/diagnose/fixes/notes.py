"""What the fixes could not offer."""

from __future__ import annotations

from collections.abc import Sequence

from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.fixes.input import (
    _main_loader,
)
from trainfast.diagnose.records.findings import Recommendation
from trainfast.margin import FASTER


def not_offered(e: Evidence) -> list[str]:
    """Notes for the candidates the replay measured and found no faster (the measurement that kept them out), the
    ones the doctor could not time (its own step that failed), and a replay done in place or not at all."""
    if e.trials is None:
        return []
    notes = [f"no candidate fix was timed on the model: {e.trials.reason}"] if e.trials.reason else []
    if e.trials.in_place:
        notes.append(f"{e.trials.model} could not be copied, so the candidates were timed on the model itself, its "
                     "gradients, buffers and layout put back after each")
    for key, trial in e.trials.trials.items():
        what = {"amp": "mixed precision", "fp32": "float32", "channels_last": "channels_last",
                "contiguous": "NCHW"}.get(key, trial.setting)
        if trial.failed:
            notes.append(f"{what} not measured: {trial.reason} (each candidate is timed on its own: this failure "
                         "stopped no other)")
        elif trial.measured and not trial.faster:
            notes.append(f"{what} not recommended: the model's forward and backward under {trial.setting} ran "
                         f"{trial.factor:.2f}x as fast as the script's ({trial.spread()}, measured on its own "
                         f"input; a fix must be {FASTER:.2f}x or more in most rounds)")
    return notes


# The fixes that act on the input side: an input-bound verdict with none of them says why
INPUT_FIXES = frozenset({"num_workers", "in_memory", "pin_memory", "persistent_workers", "prefetch_factor",
                         "shm_size", "decode_size", "copy_on_read"})


def why_no_input_fix(e: Evidence, recommendations: Sequence[Recommendation]) -> str | None:
    """For an input-bound step that no input-side fix addresses: what stands in the way, and what is left."""
    if e.verdict != "input-bound" or INPUT_FIXES & {r.id for r in recommendations}:
        return None
    cheaper = ("make each batch cheaper to produce (decode at the size trained: Pillow's draft() or `trainfast "
               "pack`; pre-process once instead of every epoch; augment on the device)")
    loader = _main_loader(e)
    if loader is None:
        return (f"no input-side fix to propose: no DataLoader fed training, so the loop prepares its batches itself "
                f"between steps; move that work into a DataLoader with workers, or {cheaper}")
    if loader.num_workers >= e.cpus - (e.device == "cuda") and not (e.workers is not None and e.workers.wait):
        return (f"no input-side fix to propose: loader #{loader.index} already runs {loader.num_workers} worker(s) "
                f"on {e.cpus} usable CPU(s), so more workers would only share the same cores; {cheaper}")
    return f"no input-side fix to propose from what was measured; {cheaper}"
