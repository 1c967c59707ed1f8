"""Two doctor reports side by side (`trainfast compare BASE NEW`), and the regression gate on them (pure functions).

What is compared. A window report (`trainfast doctor`): samples/s, and each part of the step in seconds per step
(the mean over the `timeline` rows of `wait_s`, `transfer_s`, `host_s`, `collect_s`, `compute_s`, and of
`total_s`). A whole-run report (`whole_run` not null): wall time per sample (`whole_run.seconds_per_sample`), the
training phase's samples/s, each part of a training step from the `throughput` intervals, each phase's seconds and
share, and goodput.

The units of noise. A window report's units are its measured steps (`timeline` rows); a whole run's are its
`throughput` intervals (consecutive steps, over their own training time), all but the first, which holds the
warm-up and any compilation. A report needs `MIN_UNITS` of them: fewer cannot show how much its speed varies.

The interval of a change. Each report's units are resampled with replacement (`RESAMPLES` times, seeded, so the
same two reports always give the same intervals), independently for BASE and NEW. In each resample a run's
seconds per sample is its reported figure (1 / samples/s over the measured window; a whole run's wall time per
sample) with the share of it that training takes (all of a window; a whole run's goodput) moved by the resample:
times the resampled units' seconds per sample (their seconds summed over their samples summed) over all units'.
A whole run's time outside training (startup, compile, evaluation, checkpoints, ...) is one figure per run, with
no spread to resample, and stays as measured; a note says when it is most of the run. Each part's seconds per
step is its sum over the steps' sum in the resampled units. The 2.5th and 97.5th percentiles of NEW's figure over
BASE's across the resamples are the 95 % interval of the change. Phases and goodput are shown without one.

Several runs a side. Each side may be several reports of the same code (checked against each other as BASE
against NEW). The figures are each side's means over its runs; the units of every run of a side are pooled for
the parts of the step. In each resample, each run's seconds per sample is moved by a resample of its own units (as
above), then the side draws as many runs as it has, with replacement, their deviations from the side's mean
widened by sqrt(n / (n - 1)) (drawing n of n understates their variance by (n - 1) / n), and averages them: the
spread between runs enters the interval. One run a side cannot tell a swing of the machine between runs (a whole
run 22 % slower, unchanged) from a change; three a side widen the interval by it instead. What makes the runs
comparable is said line by line (`comparability`): the machine, torch, the shape, other processes' CPU use.

The gate (`judge`). "% slower" is NEW's time per sample over BASE's, less 1 (15 % slower: each sample takes 1.15x
as long, samples/s x 1/1.15); the measure is samples/s for a window report and the wall time per sample for a whole
run. With `fail_slower` PCT:
- fail (exit 1) when the slowdown's lower bound, the interval's edge closest to no change, is above PCT %: slower by
  more than PCT beyond the noise;
- cannot decide (exit 0, with a warning) when the interval reaches above PCT % but not its lower bound, and either
  its half-width (the noise) is larger than PCT, so these two runs cannot tell a PCT % slowdown from none, or it
  reaches past 2 x PCT, so it cannot rule out a slowdown of twice the allowance. Measuring more steps (or on a
  quieter machine) narrows it. Passing is the choice here: a gate that failed on noise would fail runs of the same
  script; the warning says the gate did not judge;
- cannot decide either, for whole runs, when the slowdown's lower bound is above PCT but, with BASE's start-up
  (NEW's start-up time per sample taken as BASE's), it would not be, and the start-up grew by at most
  `STARTUP_NOISE`: a start-up is one figure per run, with no spread to tell a change from the machine's
  run-to-run noise (the interpreter and the imports read from disk). Beyond `STARTUP_NOISE` it fails (a start-up
  60 s longer is a slower run);
- cannot decide either when a run the verdict rests on was slowed by other processes (the report's
  `contention`: at least `CONTENTION_CORES` cores busy, and `CONTENTION_SHARE` of the machine's): a failure whose
  NEW was contended (the slowdown may be theirs), a pass whose BASE was (a slowed yardstick hides a slowdown);
- pass (exit 0) otherwise.
So a pass says the interval stays below PCT, or below 2 x PCT with a noise of at most PCT: at `--fail-slower 5`
a real 15 % slowdown passes only when it measured 5 % plus its noise (2 standard errors) below the truth, with
that noise at most 5 % (for normal noise, at worst 1 in 20,000); otherwise it fails, or the gate says it cannot
decide. Two runs of the same script fail only when their measured gap exceeds PCT beyond the noise of both, with
NEW uncontended.

With one run a side, the interval covers the noise within each run, step to step. A shift between the two runs as a
whole is not noise the steps can show (several runs a side show it, above): other processes' CPU use is judged
above; the notes name what else the reports record (a different torch, a script that failed), and PCT is the
allowance for the rest.

Reports that cannot be compared raise `IncomparableError` naming why: not a doctor report, a different script or
arguments, a different shape (loaders' batch sizes, world size), another machine (CPU model, usable CPUs, GPUs), a
whole run against a window, no or too few measured steps, no samples counted.
"""

from trainfast.diagnose.compare.figures import (
    CONFIDENCE,
    MIN_UNITS,
    STARTUP_NOISE,
    WINDOW,
    Change,
    Comparison,
    Gate,
    IncomparableError,
    Slowdown,
)
from trainfast.diagnose.compare.gate import compare, judge, notes
from trainfast.diagnose.compare.units import check_comparable, check_report

__all__ = ["CONFIDENCE", "MIN_UNITS", "STARTUP_NOISE", "WINDOW", "Change", "Comparison", "Gate", "IncomparableError",
           "Slowdown", "check_comparable", "check_report", "compare", "judge", "notes"]
