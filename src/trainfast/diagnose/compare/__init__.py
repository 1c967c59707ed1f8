"""Two doctor reports side by side (`trainfast compare BASE NEW`), and the regression gate on them (pure functions).

What is compared. A window report (`trainfast doctor`): samples/s, and each part of the step in seconds per step
(the mean over the `timeline` rows of `wait_s`, `transfer_s`, `host_s`, `collect_s`, `compute_s`, and of
`total_s`). A whole-run report (`whole_run` not null): wall time per sample (`whole_run.seconds_per_sample`), the
training phase's samples/s, each part of a training step from the `throughput` intervals, each phase's seconds and
share, and goodput.

The units of noise. A window report's units are its measured steps (`timeline` rows); a whole run's are its
`throughput` intervals (consecutive steps, over their own training time), all but the first, which holds the
warm-up and any compilation. A report needs `MIN_UNITS` of them: fewer cannot show how much its speed varies.

The intervals of the parts. Each report's units are resampled with replacement (`RESAMPLES` times, seeded, so the
same two reports always give the same intervals), independently for BASE and NEW. In each resample a run's
seconds per sample is its reported figure (1 / samples/s over the measured window; a whole run's wall time per
sample) with the share of it that training takes (all of a window; a whole run's goodput) moved by the resample:
times the resampled units' seconds per sample over all units'. A whole run's time outside training (startup,
compile, evaluation, checkpoints, ...) is one figure per run, with no spread to resample, and stays as measured; a
note says when it is most of the run. Each part's seconds per step is its sum over the steps' sum in the resampled
units. The 2.5th and 97.5th percentiles across the resamples are the 95 % interval of a part's change, and of the
slowdown within the runs (`Comparison.within`): what the runs' own steps show, with no spread between runs in it.

The slowdown the gate judges. Each run is one speed (samples/s; a whole run's samples per wall second), and the
sides are compared by the one decision (`trainfast.decide`): paired when the runs were measured in interleaved
pairs (`--runs`: BASE i beside NEW i), as two samples when they were not (reports a side), the spread *between* runs
making the interval, a run more than `decide.STALL` slower than its side's median set aside as stalled. One run a
side has no spread between runs: its interval is the drift adjacent runs of one script can have here
(`decide.drift_bound`, +-47 %), so a swing of the machine between two runs (a whole run 22 % slower, unchanged)
is never read as a change. What makes the runs comparable is said line by line (`comparability`): the machine,
torch, the shape, other processes' CPU use.

The gate (`judge`). "% slower" is NEW's time per sample over BASE's, less 1 (15 % slower: each sample takes 1.15x
as long, samples/s x 1/1.15). With `fail_slower` PCT, on the decision at the threshold 1 + PCT / 100:
- fail (exit 1) when the decision is "slower": the estimate beyond PCT and the interval clear of no change;
- pass (exit 0) when the interval rules out a slowdown of 2 x PCT;
- cannot tell (exit 3, or 0 / 1 with `inconclusive` "pass" / "fail") otherwise, saying the smallest change these
  runs could detect and about how many runs a side would tell PCT; and when a verdict would rest on a run other
  processes slowed (the report's `contention`: at least `CONTENTION_CORES` cores busy, and `CONTENTION_SHARE` of
  the machine's): a failure whose NEW was contended, a pass whose BASE was; and, for whole runs, when the slowdown
  would not be beyond PCT with BASE's start-up and the start-up grew by at most `STARTUP_NOISE` (one figure per
  run, which varies that much between runs of the same script). Beyond `STARTUP_NOISE` it fails (a start-up 60 s
  longer is a slower run).
The decision's error rates are held on simulated noise (tests/unit/test_decide.py): runs of the same script called
slower in under 1 %, a 15 % slowdown found in over 90 % within `--runs 3 --max-runs 12`.

Two versions of a script (`versions`, `--runs OLD NEW`) differ by design: they are checked for the same arguments,
batch sizes, world size, data (each loader's dataset and batches an epoch) and model (FLOPs a step within 1 %), not
for the same file.

Reports that cannot be compared raise `IncomparableError` naming why: not a doctor report, a different script or
arguments, a different shape (loaders' batch sizes, world size), another machine (CPU model, usable CPUs, GPUs), a
whole run against a window, no or too few measured steps, no samples counted, a script that crashed.
"""

from trainfast.diagnose.compare.figures import (
    CONFIDENCE,
    INCONCLUSIVE,
    MIN_UNITS,
    STARTUP_NOISE,
    WINDOW,
    Change,
    Comparison,
    Gate,
    IncomparableError,
    Slowdown,
)
from trainfast.diagnose.compare.gate import compare, notes
from trainfast.diagnose.compare.judge import judge
from trainfast.diagnose.compare.units import check_comparable, check_report

__all__ = ["CONFIDENCE", "INCONCLUSIVE", "MIN_UNITS", "STARTUP_NOISE", "WINDOW", "Change", "Comparison", "Gate",
           "IncomparableError", "Slowdown", "check_comparable", "check_report", "compare", "judge", "notes"]
