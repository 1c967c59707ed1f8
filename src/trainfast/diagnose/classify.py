"""The verdict: which part of a training step limits it. Pure functions over measured fractions.

Each threshold is a named constant with where it comes from. On a CPU-only run the same verdicts apply,
"compute" being the model step on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

# PyTorch's TensorBoard profiler plugin flagged a DataLoader bottleneck when data wait exceeded 5 % of
# the step; the same bar here.
DATA_WAIT_BOUND = 0.05
# A tenth of the step blocked in host-to-device copies: pinned memory + non_blocking copies on a side
# stream (DevicePrefetcher) would hide nearly all of it.
TRANSFER_BOUND = 0.10
# A fifth of the step in Python between optimizer steps (logging, metrics, checkpoints, tiny kernels):
# the device sits idle for that long every step.
HOST_BOUND = 0.20
# At or above this share of the step in forward/backward/optimizer, the device (or the CPU) is the limit.
COMPUTE_BOUND = 0.85
# NVML utilisation only says *some* kernel ran in the sample window; below half, with no data wait,
# the GPU is starved by the host.
LOW_GPU_UTIL = 50.0
# DALI's rule for a loader replayed alone: within 1.5x of the training rate a bottleneck is possible,
# within 1.1x it is certain.
REPLAY_POSSIBLE = 1.5
REPLAY_CERTAIN = 1.1

VERDICTS = ("input-bound", "transfer-bound", "host-bound", "compute-bound", "balanced")


@dataclass(frozen=True)
class Fractions:
    """Shares of step wall time; they sum to 1."""

    data_wait: float
    transfer: float
    host: float
    compute: float

    @classmethod
    def of(cls, *, total_s: float, wait_s: float, transfer_s: float, host_s: float) -> Fractions:
        if total_s <= 0:
            return cls(0.0, 0.0, 0.0, 0.0)
        wait, transfer, host = wait_s / total_s, transfer_s / total_s, host_s / total_s
        return cls(wait, transfer, host, max(0.0, 1.0 - wait - transfer - host))

    def to_json(self) -> dict[str, float]:
        return {"data_wait": self.data_wait, "transfer": self.transfer, "host": self.host, "compute": self.compute}


@dataclass(frozen=True)
class Verdict:
    name: str
    reason: str


def classify(f: Fractions, *, device: str, gpu_util: float | None = None,
             loader_headroom: float | None = None) -> Verdict:
    """The limiting part of the step.

    `gpu_util`: mean NVML utilisation (%) while measuring, if known. `loader_headroom`: the loader's
    throughput replayed alone divided by the training throughput, if measured.
    """
    pct = f"data wait {f.data_wait:.0%}, transfer {f.transfer:.0%}, host {f.host:.0%}, compute {f.compute:.0%}"
    if loader_headroom is not None and loader_headroom <= REPLAY_CERTAIN:
        return Verdict("input-bound", f"the loader alone delivers only {loader_headroom:.2f}x the rate training "
                                      f"consumes (<= {REPLAY_CERTAIN}x: certain bottleneck); {pct}")
    # A loader replayed alone at more than 1.5x the training rate cannot be what limits training: what data
    # wait remains is jitter (a slow batch now and then), not throughput.
    loader_fast = loader_headroom is not None and loader_headroom > REPLAY_POSSIBLE
    wait_bound = 1.0 if loader_fast else DATA_WAIT_BOUND
    wasted = [(share, name, why) for share, name, why, bound in (
        (f.data_wait, "input-bound", "the step waits for the next batch", wait_bound),
        (f.transfer, "transfer-bound", "the step waits for host-to-device copies", TRANSFER_BOUND),
        (f.host, "host-bound", "Python between optimizer steps keeps the device idle", HOST_BOUND),
    ) if share > bound]
    if wasted:
        share, name, why = max(wasted)
        return Verdict(name, f"{why}: {share:.0%} of each step; {pct}")
    if device == "cuda" and gpu_util is not None and gpu_util < LOW_GPU_UTIL:
        return Verdict("host-bound", f"GPU busy only {gpu_util:.0f}% of the time while the step is not waiting on "
                                     f"data: launch overhead, small kernels or syncs; {pct}")
    jitter = ""
    if loader_fast and f.data_wait > DATA_WAIT_BOUND:
        jitter = f"; the {f.data_wait:.0%} data wait is jitter: the loader alone is {loader_headroom:.1f}x faster"
    if f.compute + (f.data_wait if loader_fast else 0.0) >= COMPUTE_BOUND:
        where = "the model step on the CPU" if device == "cpu" else "the GPU"
        return Verdict("compute-bound", f"{where} takes {f.compute:.0%} of each step; {pct}{jitter}")
    hint = jitter
    if loader_headroom is not None and loader_headroom <= REPLAY_POSSIBLE:
        hint = f"; the loader alone is only {loader_headroom:.2f}x faster than training: a possible bottleneck"
    return Verdict("balanced", f"no single part dominates ({pct}){hint}")
