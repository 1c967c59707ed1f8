"""What a whole run's ledger records (capture/ledger.py): the categories of time carved out of the run, checkpoint
writes and evaluation passes."""

from __future__ import annotations

from dataclasses import dataclass

# Categories carved out of the run, highest priority first where two overlap (a save inside an evaluation pass
# counts as the save); the rest of the run is startup, train or other by where it falls.
DOCTOR, CHECKPOINT, SLEEP, LOGGING, EVALUATION, EPOCH_START = ("doctor", "checkpoint", "sleep", "logging",
                                                               "evaluation", "epoch_start")


CARVED = (DOCTOR, CHECKPOINT, SLEEP, LOGGING, EVALUATION, EPOCH_START)


@dataclass
class Write:
    api: str  # "torch.save", "safetensors", "dcp.save", "dcp.async_save"
    start: float
    end: float
    bytes: int | None
    background: bool = False  # written on another thread: it blocked no step


@dataclass
class EvalPass:
    start: float
    end: float
    wait_s: float = 0.0
    forwards: int = 0
    autocast_forwards: int = 0
    step: int = 0  # closed training steps when it began: a later step closes the pass
