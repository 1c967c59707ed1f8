"""The checkpoint state the Trainer owns: what a checkpoint holds (model, optimizer, schedule, loss scaler, position,
loss so far, RNG of every rank, the practices chosen), writing it from rank 0 with every rank agreeing on the
outcome, and restoring it for `fit(resume=...)`. The files themselves (atomic writes, rotation, validation) are
`checkpoint.py`'s."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from trainfast.precision.policy import LossScaler, resolve_precision
from trainfast.trainer.callbacks import emit
from trainfast.trainer.checkpoint import (
    CheckpointError,
    CheckpointWriteError,
    load_checkpoint,
    load_latest_good,
    rng_state,
    save_checkpoint,
    set_rng_state,
    versions,
)
from trainfast.trainer.config import ConfigError, TrainConfig
from trainfast.trainer.distributed import DistInfo, gather
from trainfast.trainer.loss_window import LossWindow
from trainfast.trainer.practices import Practices

log = logging.getLogger("trainfast")


class Owner(Protocol):
    """What of the Trainer its state is: the parts a checkpoint holds and where they go."""

    config: TrainConfig
    dist: DistInfo
    device: torch.device
    callbacks: list[object]
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR | None
    scaler: LossScaler
    practices: Practices
    losses: LossWindow
    epoch: int
    step: int
    batch: int
    best_metric: float | None


class TrainerState:
    """Capture, save and restore a `Trainer`'s whole training state (as a connector owned by its Trainer)."""

    def __init__(self, trainer: Owner) -> None:
        self.trainer = trainer
        self.saved_practices: dict[str, str] | None = None  # what the run a restored checkpoint came from chose

    def capture(self, rng_per_rank: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        t = self.trainer
        assert t.scheduler is not None
        rngs = rng_per_rank or [rng_state(t.device)]
        return {"model": t.model.state_dict(), "optimizer": t.optimizer.state_dict(),
                "scheduler": t.scheduler.state_dict(), "scaler": t.scaler.state_dict(),
                "epoch": t.epoch, "step": t.step, "batch": t.batch, "best_metric": t.best_metric,
                "epoch_loss": list(t.losses.epoch), "rng": rngs[0], "rng_per_rank": rngs,
                "config": t.config.to_dict(), "practices": t.practices.saved(), "versions": versions(),
                "format": 1}

    def save(self, path: Path) -> Path:
        """Collective under DDP: every rank calls it, rank 0 writes, all learn the outcome (see `Trainer.save`)."""
        t = self.trainer
        rngs = gather(rng_state(t.device))  # each rank's RNG (its dropout stream) is part of an exact resume
        failed: CheckpointWriteError | None = None
        if t.dist.is_main:
            try:
                save_checkpoint(self.capture(rngs), path, t.config.keep_checkpoints)
            except CheckpointWriteError as e:
                failed = e
            else:
                emit(t.callbacks, "on_checkpoint", t, path)
        # Rank 0's outcome reaches every rank here, once its write is done (the wait a barrier gave): a failure
        # stops all ranks together instead of leaving the others waiting for a file that never comes.
        outcome = gather(None if failed is None else str(failed))[0]
        if failed is not None:
            raise failed
        if outcome is not None:
            raise CheckpointWriteError(outcome)
        return path

    def restore(self, resume: bool | str | Path, trusted: bool) -> None:
        t, cfg = self.trainer, self.trainer.config
        if resume is True:
            if not cfg.checkpoint_dir:
                raise ConfigError("resume=True needs checkpoint_dir (where last.pt lives), or pass the checkpoint path")
            # Loaded on the CPU (checkpoint.py decides): load_state_dict copies into the parameters' device.
            found = load_latest_good(Path(cfg.checkpoint_dir) / "last.pt", cfg.keep_checkpoints, trusted=trusted)
            if found is None:
                log.info("resume: no checkpoint in %s yet; starting from scratch", cfg.checkpoint_dir)
                return
            path, state = found
        else:
            path = Path(resume)  # type: ignore[arg-type]
            state = load_checkpoint(path, trusted=trusted)
        assert t.scheduler is not None
        try:
            t.model.load_state_dict(state["model"])
            t.optimizer.load_state_dict(state["optimizer"])
            t.scheduler.load_state_dict(state["scheduler"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(f"checkpoint {str(path)!r} does not fit this model/optimizer: {e}") from e
        self.saved_practices = state.get("practices")  # absent from checkpoints written before it was saved
        kept = (self.saved_practices or {}).get("precision") if cfg.precision == "auto" else None
        if kept is not None and resolve_precision(kept, t.practices.caps).needs_scaler != t.scaler.enabled:
            # "auto" resumes in the precision the run started with (Practices.plan): its loss scaler with it
            t.scaler = LossScaler(t.device, not t.scaler.enabled, cfg.scaler)
        if not t.scaler.load_state_dict(state["scaler"]) and t.scaler.enabled:  # saved in bf16 or fp32
            log.info("resume: %s holds no loss scaler state (saved without fp16 loss scaling); this fp16 run "
                     "starts a fresh loss scaler at scale %g", path, t.scaler.loss_scale)
        t.epoch, t.step, t.batch = state["epoch"], state["step"], state["batch"]
        t.losses.from_step = t.step
        t.best_metric = state["best_metric"]
        t.losses.epoch = list(state["epoch_loss"])
        per_rank = state.get("rng_per_rank") or [state["rng"]]
        set_rng_state(per_rank[t.dist.rank] if len(per_rank) == t.dist.world_size else state["rng"], t.device)
        log.info("resumed from %s: epoch %d, batch %d, step %d", path, t.epoch + 1, t.batch, t.step)
