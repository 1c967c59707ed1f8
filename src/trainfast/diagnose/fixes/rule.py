"""A fix the doctor proposes (`Recommendation`) and how its expected gain is put.

`expected_gain` is the throughput ratio after the fix (1.8 = 1.8x the samples/s); None where no honest figure
exists. Its `gain_basis` says where it comes from:
- "measured": every factor in it was timed in this run: the step's own split (data wait, host, startup), or the
  candidate replayed on the script's own model and input (probe.py: a precision, a layout, a thread count);
- "verified": `--verify` re-ran the script with the fix (verify.py sets it);
- "estimate": a factor from elsewhere (a named constant beside its rule, with its source), with `basis_reason` saying
  why nothing was measured. An estimate never outranks a measurement, and a candidate measured no faster is not
  offered at all (recommend.py's `not_offered` says so in a note).

The rules themselves: the input pipeline's in input_fixes.py, the model step's and the collectives' in
recommend.py, which ranks them all.
"""

from __future__ import annotations

from typing import Any

from trainfast.diagnose.evidence.evidence import Evidence

# A fix estimated below this is within the noise of a re-measurement: not worth proposing.
MIN_GAIN = 1.02


# Why an estimate is one, for the fixes no replay can time
VERIFY_IT = "--verify re-runs the script with it"


NEEDS_EDIT = "it needs a change to the script, which the doctor cannot make to time it"


def speedup_of_part(share: float, factor: float) -> float:
    """Whole-step gain when a part taking `share` of the step gets `factor` times faster (Amdahl)."""
    return 1.0 / (1.0 - share + share / factor)


def measured_faster(e: Evidence, key: str) -> tuple[Any, float] | None:
    """The replay's trial of `key` and the step's gain from it, where it measured faster by at least MIN_GAIN."""
    trial = e.trials.get(key) if e.trials is not None else None
    gain = trial.gain(e.fractions.compute, e.compute_s) if trial is not None and trial.faster else None
    return (trial, gain) if gain is not None and gain >= MIN_GAIN else None
