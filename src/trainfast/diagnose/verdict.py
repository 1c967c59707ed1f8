"""The verdict: which part of a training step limits it, and how much is at stake. Pure functions.

Each part other than compute (data wait, transfer, host, a collection phase, exposed communication across ranks) is
judged by the most removing it could give
(Amdahl: a part taking share s of the step caps the gain at 1 / (1 - s)). A part is *the limit* when that
cap is at least 1.33x (a quarter of the step); it is a *small cost* below 1.18x (15 %); in between no single
part dominates ("balanced"). The gap between the two bars is the stability band: a share measured at 10 %
in one run and 12 % in the next gives the same verdict, where a single 5 % switch flipped. With per-step
intervals (bootstrap over the measured steps), a part must be the limit at the interval's lower end and
small at its upper end, so a noisy measurement reads "balanced" rather than a confident wrong verdict.
On a CPU-only run the same verdicts apply, "compute" being the model step on the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping

from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.records.findings import Verdict
from trainfast.diagnose.records.steps import PARTS, Fractions, max_speedup

# A part is the limit when removing it would make the step at least 1 / (1 - 0.25) = 1.33x faster.
LIMIT_SHARE = 0.25


# A part below this is a small cost: removing it gains less than 1 / (1 - 0.15) = 1.18x.
SMALL_SHARE = 0.15


# PyTorch's TensorBoard profiler plugin flagged a DataLoader bottleneck when data wait exceeded 5 % of the
# step: loader fixes are worth proposing (and measuring) above it, even when the verdict is compute-bound.
DATA_WAIT_BOUND = 0.05


# A fifth of the step in Python between optimizer steps: a larger batch amortises it.
HOST_BOUND = 0.20


# NVML utilisation only says *some* kernel ran in the sample window; below half, with no data wait,
# the GPU is starved by the host.
LOW_GPU_UTIL = 50.0


# DALI's rule for a loader replayed alone: within 1.5x of the training rate a bottleneck is possible,
# within 1.1x it is certain.
REPLAY_POSSIBLE = 1.5


REPLAY_CERTAIN = 1.1


VERDICTS = ("input-bound", "transfer-bound", "host-bound", "communication-bound", "compute-bound", "balanced")


# part -> (verdict, what the step waits for, where the gain would come from)
_PART_TEXT = {
    "data_wait": ("input-bound", "the step waits for the next batch", "from the input pipeline"),
    # no loader to time: the gap before each forward is batch preparation and whatever else the loop does there
    "script_input": ("input-bound", "the loop spends this long before each forward (no DataLoader to time: preparing "
                     "the batch, and any other work between steps, such as an EMA update or logging)",
                     "from that work"),
    "transfer": ("transfer-bound", "the step waits for host-to-device copies", "from the copies"),
    "host": ("host-bound", "Python between steps keeps the device idle", "from the host work"),
    # no-grad forwards in training mode before an update (timeline.py): host work in the loop, as "host" is
    "collection": ("host-bound", "the loop collects between updates (rollout / host work between updates: no-grad "
                   "forwards in training mode and the work around them, such as environment steps)",
                   "from collecting faster (vectorised environments, batched action choice, fewer steps per update)"),
    # blocked in collectives (comms.py): the gradient all-reduce, FSDP's all-gathers and reduce-scatters, and the wait
    # for the slowest rank to join them
    "communication": ("communication-bound", "the step waits for collectives across ranks (communication not "
                      "overlapped with compute, or a slower rank joining late)",
                      "from overlapping or shrinking the communication"),
}


def classify(f: Fractions, *, device: str, gpu_util: float | None = None, loader_headroom: float | None = None,
             intervals: Mapping[str, tuple[float, float]] | None = None, loader_fed: bool = True) -> Verdict:
    """The limiting part of the step.

    `gpu_util`: mean GPU utilisation (%) while measuring, if known. `loader_headroom`: the loader's throughput
    replayed alone divided by the training throughput, if measured. `intervals`: (low, high) of each part's
    share over the measured steps (`share_interval`); without them the shares are taken as exact.
    `loader_fed`: False when no DataLoader fed training, so "data wait" is the whole gap before each forward.
    """
    pct = f"data wait {f.data_wait:.0%}, transfer {f.transfer:.0%}, host {f.host:.0%}, compute {f.compute:.0%}"
    if f.collection:
        pct += f", rollout / host work between updates {f.collection:.0%}"
    if f.communication:
        pct += f", communication {f.communication:.0%}"
    if loader_headroom is not None and loader_headroom <= REPLAY_CERTAIN:
        return Verdict("input-bound", f"the loader alone delivers only {loader_headroom:.2f}x the rate training "
                                      f"consumes (<= {REPLAY_CERTAIN}x: certain bottleneck); {pct}")
    # A loader replayed alone at more than 1.5x the training rate cannot be what limits training: what data
    # wait remains is jitter (a slow batch now and then), not throughput.
    loader_fast = loader_headroom is not None and loader_headroom > REPLAY_POSSIBLE
    parts = [p for p in PARTS if not (p == "data_wait" and loader_fast)]

    def low_high(part: str) -> tuple[float, float]:
        share = f.share(part)
        return intervals.get(part, (share, share)) if intervals else (share, share)

    limits = [p for p in parts if low_high(p)[0] >= LIMIT_SHARE]
    if limits:
        part = max(limits, key=f.share)
        name, why, source = _PART_TEXT["script_input" if part == "data_wait" and not loader_fed else part]
        return Verdict(name, f"{why}: {f.share(part):.0%} of each step, up to {max_speedup(f.share(part)):.2f}x "
                             f"{source}; {pct}")
    if device == "cuda" and gpu_util is not None and gpu_util < LOW_GPU_UTIL:
        return Verdict("host-bound", f"GPU busy only {gpu_util:.0f}% of the time while the step is not waiting on "
                                     f"data: launch overhead, small kernels or syncs; {pct}")
    costs = [f"{p.replace('_', ' ')} {f.share(p):.0%} (<= {max_speedup(f.share(p)):.2f}x {_PART_TEXT[p][2]})"
             for p in parts if f.share(p) >= 0.01]
    hint = ""
    if loader_fast and f.data_wait > DATA_WAIT_BOUND:
        hint = f"; the {f.data_wait:.0%} data wait is jitter: the loader alone is {loader_headroom:.1f}x faster"
    elif loader_headroom is not None and loader_headroom <= REPLAY_POSSIBLE:
        hint = f"; the loader alone is only {loader_headroom:.2f}x faster than training: a possible bottleneck"
    if all(low_high(p)[1] < SMALL_SHARE for p in parts):
        where = "the model step on the CPU" if device == "cpu" else "the GPU"
        small = f", with small costs: {', '.join(costs)}" if costs else ""
        return Verdict("compute-bound", f"{where} takes {f.compute:.0%} of each step{small}; {pct}{hint}")
    uncertain = [p for p in parts if f.share(p) >= LIMIT_SHARE]  # large on average, not at the interval's low end
    if uncertain:
        part = max(uncertain, key=f.share)
        low, high = low_high(part)
        why = (f"close to the bar for the limit ({LIMIT_SHARE:.0%} of the step)" if high - low < 0.1 else
               "too uneven between steps to call it the limit (too few steps, or one unlike the rest: measure more "
               "with --steps)")
        return Verdict("balanced", f"no part is the limit with confidence: {part.replace('_', ' ')} is "
                                   f"{f.share(part):.0%} of the time overall, {low:.0%}-{high:.0%} over the "
                                   f"measured steps: {why}; {pct}{hint}")
    return Verdict("balanced", f"no single part dominates: compute {f.compute:.0%}, {', '.join(costs)}; "
                               f"{pct}{hint}")


def no_verdict_reason(seen: dict[str, int], warmup: int) -> str:
    """What was seen when no step was measured, and what to do."""
    if not seen:
        return "no training step was measured"
    counts = (f"{seen.get('batches', 0)} batch(es) fetched, {seen.get('forwards', 0)} model forward(s), "
              f"{seen.get('backwards', 0)} backward pass(es), {seen.get('optimizer_steps', 0)} optimizer step(s)")
    if not seen.get("backwards") and not seen.get("optimizer_steps"):
        return (f"no training step was seen: {counts}. A step is an optimizer.step() or, without an optimizer, a "
                "backward pass (loss.backward() or torch.autograd.backward): is the script training (not only "
                "evaluating), and does it reach its loop before --max-seconds? Gradients taken with torch.func "
                "(grad, vmap) or torch.autograd.grad, with no optimizer, are not seen as steps")
    return (f"fewer than {warmup + 1} steps ran (warm-up {warmup}): {counts}. Lower --warmup, raise --max-seconds, "
            "or give the script more steps")


# MFU bands for a compute-bound verdict: near the peak only less work helps; far below it the step is made of
# small kernels, launch overhead or the wrong layout/precision, which compile, a larger batch or CUDA graphs fix.
NEAR_PEAK, FAR_BELOW_PEAK = 0.5, 0.2


def with_peak(verdict: Verdict, compute: Mapping[str, object] | None, device: str = "cuda",
              precision_hint: bool = True) -> Verdict:
    """A compute-bound verdict says how far from the peak the compute runs (`compute`: the report's entry), which
    decides the fix. `precision_hint` False: the report measured another precision no faster (or the run's own
    slower), so none is suggested."""
    mfu = compute.get("mfu") if compute else None
    if verdict.name != "compute-bound" or not isinstance(mfu, (int, float)) or compute is None:
        return verdict
    source = "a datasheet's" if str(compute["peak_source"]).startswith("table") else "a measured"
    where = f"model FLOPs utilisation {mfu:.0%} of {source} {compute['peak_precision']} peak"
    if mfu >= NEAR_PEAK:
        faster = " or a faster precision" if precision_hint else ""
        advice = ("near the hardware's limit at this precision: only less work (a smaller model, fewer FLOPs per "
                  f"sample){faster} helps")
    elif mfu < FAR_BELOW_PEAK:
        hints = ["torch.compile", "a larger batch"] + (["mixed precision"] if precision_hint else []) + \
            (["CUDA graphs"] if device == "cuda" else [])
        held = "layout or precision" if precision_hint else "layout"
        advice = (f"far below the peak: small kernels, launch overhead, {held} hold it back "
                  f"({', '.join(hints)})")
    else:
        advice = "between the two: both more efficient kernels and less work can help"
    return Verdict(verdict.name, f"{verdict.reason}; {where}: {advice}")


def precision_may_pay(e: Evidence) -> bool:
    """Whether another precision is worth a hint: not where the run autocasts already (its own precision was
    measured against float32: `fp32`) or where mixed precision was measured no faster or cannot apply."""
    trial = e.trials.get("amp") if e.trials is not None else None
    return not e.autocast and not (trial is not None and (not trial.applies or (trial.measured and not trial.faster)))


def verdict_of(e: Evidence) -> Verdict | None:
    """The verdict with its qualifiers, from the evidence alone (None when no step was measured): the limiting part
    (`classify`), how far from the peak a compute-bound step runs (`with_peak`), and how an input-bound step's loader
    workers spent their time (workers.py)."""
    if not e.steps:
        return None
    verdict = classify(e.fractions, device=e.device, gpu_util=e.gpu_util, loader_headroom=e.loader_headroom,
                       intervals=e.intervals, loader_fed=e.input_source != "script")
    verdict = with_peak(verdict, e.compute, e.device, precision_hint=precision_may_pay(e))
    if verdict.name == "input-bound" and e.workers is not None and e.input_source != "script":
        verdict = Verdict(verdict.name, f"{verdict.reason}; {e.workers.phrase()}")
    return verdict
