"""What a whole run's fixes time once the script has ended: the evaluation under autocast + inference_mode against the
script's own, and a copy to host memory's bandwidth."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from trainfast.diagnose.capture.ledger import Ledger, module_device_type
from trainfast.diagnose.records.capture import WholeRecord
from trainfast.diagnose.records.trials import Trial

if TYPE_CHECKING:
    pass


# A copy to host memory of this many bytes times the memory bandwidth that a background write still blocks for
COPY_PROBE_BYTES = 64 * 2**20


# The evaluation trial: rounds of fp32 / mixed pairs after a warm-up each, within this many seconds
EVAL_ROUNDS, EVAL_MIN_ROUNDS, EVAL_BUDGET_S = 7, 3, 5.0


@dataclass
class WholeRun:
    """What a whole run measured for the report: the `whole_run` entry (wholerun.py), the evaluation's precision
    trial and the host-memory copy bandwidth a background checkpoint write would still block for."""

    entry: dict[str, Any]
    trial: Trial | None = None
    bandwidth: float | None = None
    # what the entry was accounted from (its capture: snapshot.py)
    ledger: Ledger | None = None
    end: float | None = None
    compiled: bool = False
    warmup: int = 0
    lost: dict[str, Any] | None = None  # attempts.py's `lost_progress`, set with the entry's

    def record(self) -> WholeRecord:
        assert self.ledger is not None and self.end is not None
        return WholeRecord(ledger=self.ledger.record(), end=self.end, compiled=self.compiled, warmup=self.warmup,
                           trial=self.trial, bandwidth=self.bandwidth, lost_progress=self.lost)


def eval_trial(ledger: Ledger, autocast: tuple[tuple[str, str], ...]) -> Trial | None:
    """Time the first evaluation forward as the script ran it (fp32, no_grad) against inference_mode under the
    training's autocast dtype, interleaved; None where evaluation already ran under autocast or training did not."""
    call = ledger.eval_call
    passes = ledger.passes
    if call is None or not autocast or not passes or any(p.autocast_forwards for p in passes):
        return None
    module, args, kwargs = call
    device = module_device_type(module)
    dtype = next((getattr(torch, d) for dev, d in autocast if dev == device), None)
    if dtype is None:
        return None
    name = str(dtype).replace("torch.", "")
    setting = f"{name} autocast + inference_mode"
    was_training = module.training

    def timed(mixed: bool) -> float:
        started = time.perf_counter()
        if mixed:
            with torch.inference_mode(), torch.autocast(device, dtype=dtype):
                module(*args, **kwargs)
        else:
            with torch.no_grad():
                module(*args, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started
    module.eval()
    try:
        warm = [timed(False), timed(True)]
        rounds = min(EVAL_ROUNDS, int(EVAL_BUDGET_S / max(sum(warm), 1e-6)))
        if rounds < EVAL_MIN_ROUNDS:
            return Trial("eval_autocast", setting, reason=f"an evaluation forward pair took {sum(warm):.1f} s: "
                         f"{EVAL_MIN_ROUNDS} rounds do not fit {EVAL_BUDGET_S:g} s", value=(device, name))
        ratios, bases = [], []
        for _ in range(rounds):
            base = timed(False)
            ratios.append(base / timed(True))
            bases.append(base)
    except RuntimeError as e:
        return Trial("eval_autocast", setting, reason=f"it failed on this model ({str(e).splitlines()[0]})")
    finally:
        module.train(was_training)
        ledger.eval_call = None  # the model and its batch go with the script
    return Trial.of_rounds("eval_autocast", setting, ratios, bases, (device, name))


def copy_bandwidth() -> float:
    """Bytes per second of a copy to host memory, timed once on `COPY_PROBE_BYTES` (the best of 3)."""
    source = torch.empty(COPY_PROBE_BYTES, dtype=torch.uint8)
    target = torch.empty_like(source)
    best = min(_timed_copy(source, target) for _ in range(3))
    return COPY_PROBE_BYTES / best if best > 0 else float("inf")


def _timed_copy(source: torch.Tensor, target: torch.Tensor) -> float:
    started = time.perf_counter()
    target.copy_(source)
    return time.perf_counter() - started
