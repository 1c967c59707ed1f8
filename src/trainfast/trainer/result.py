"""`FitResult`: what `Trainer.fit` measured and where it left the checkpoints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class FitResult:
    epochs: int
    steps: int
    samples_per_s: float
    data_wait_fraction: float
    final_loss: float | None
    val_loss: float | None
    val_accuracy: float | None
    checkpoint: str | None
    best_checkpoint: str | None
    skipped_steps: int
    wall_s: float
    monitor: dict[str, Any] | None = None  # metric -> {mean, p5, p95, ...} when TrainConfig(monitor=True)
    loss_scale: float | None = None  # the fp16 loss scale at the end; None without loss scaling
    # How each practice was chosen: {chosen, reason, measured, figures, steps, pairs, decision} (trainer/practices.py)
    precision: dict[str, Any] | None = None
    channels_last: dict[str, Any] | None = None
    compile: dict[str, Any] | None = None
    # Any practice registered beyond these three (trainer/practice_kinds.py): its block by name, in the JSON beside them
    other_practices: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Optimizer steps each practice's A/B took, by name (0: none ran); each ends when decided, so this varies by run.
    # Also each block's `steps`, beside its `pairs` and `decision`
    ab_steps: dict[str, int] = field(default_factory=dict)
    # Model FLOPs utilisation of the timed steps on one device (trainfast/flops.py), None with `mfu_reason`
    mfu: float | None = None
    mfu_reason: str | None = None
    flops_per_step: int | None = None  # one batch's forward and backward (a micro-batch's under accumulation)
    peak_flops_per_s: float | None = None
    peak_source: str | None = None  # "table: ..." (a datasheet's dense figure) or "measured: ..."
    # Per checkpoint save, in order: seconds training waited for it (the capture and the copy to host memory, and a
    # previous write still in flight), and seconds its write (last.pt, then best.pt) took in the background (rank 0)
    checkpoint_blocked_s: list[float] = field(default_factory=list)
    checkpoint_write_s: list[float] = field(default_factory=list)
    # fit's wall time in the doctor's whole-run phases (trainer/phases.py): wall_s, goodput (train's share) and
    # phases ({phase, seconds, share}: startup, compile, train, evaluation, checkpoint, epoch_start, other)
    whole_run: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"epochs": self.epochs, "steps": self.steps, "samples_per_s": self.samples_per_s,
               "data_wait_fraction": self.data_wait_fraction, "final_loss": self.final_loss,
               "val_loss": self.val_loss, "val_accuracy": self.val_accuracy, "checkpoint": self.checkpoint,
               "best_checkpoint": self.best_checkpoint, "skipped_steps": self.skipped_steps, "wall_s": self.wall_s,
               "loss_scale": self.loss_scale, "precision": self.precision, "channels_last": self.channels_last,
               "compile": self.compile, "mfu": self.mfu, "mfu_reason": self.mfu_reason,
               "flops_per_step": self.flops_per_step, "peak_flops_per_s": self.peak_flops_per_s,
               "peak_source": self.peak_source, "checkpoint_blocked_s": self.checkpoint_blocked_s,
               "checkpoint_write_s": self.checkpoint_write_s, "whole_run": self.whole_run, "ab_steps": self.ab_steps}
        return out | self.other_practices | ({"monitor": self.monitor} if self.monitor is not None else {})
