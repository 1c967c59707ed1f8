"""The checkpoint state the Trainer owns: what a checkpoint holds (model, optimizer, schedule, loss scaler, position,
loss so far, RNG of every rank, the practices chosen), writing it from rank 0 with every rank agreeing on the
outcome, and restoring it for `fit(resume=...)`. The files themselves (atomic writes, rotation, validation) are
`checkpoint.py`'s.

`fit`'s end-of-epoch checkpoints are written in the background: training stops only to capture the state and copy
it to host memory (`to_host`), then one thread writes it (rank 0) while the next epoch trains. At most one write is
in flight: the next save, the end of fit, a stop signal's save or an exception leaving fit first waits for it, and
its outcome is handled there as a synchronous write's would be (`CheckpointWriteError` on every rank).

Under FSDP (`shard_checkpoints`) every rank writes its own shards into a folder (`sharded_checkpoint.py`), in the
background the same way; the folder is renamed into place only once every rank's write is known to have finished,
at that same join. Resume takes the newest good checkpoint of either kind, at any world size.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from trainfast.precision.policy import LossScaler, resolve_precision
from trainfast.trainer.callbacks import emit
from trainfast.trainer.checkpoint import (
    CheckpointError,
    CheckpointWriteError,
    copy_best,
    first_good,
    load_checkpoint,
    rng_state,
    rotated,
    save_checkpoint,
    set_rng_state,
    to_host,
    versions,
)
from trainfast.trainer.config import ConfigError, TrainConfig
from trainfast.trainer.distributed import DistInfo, gather
from trainfast.trainer.loss_window import LossWindow
from trainfast.trainer.practices import Practices
from trainfast.trainer.sharded_checkpoint import (
    ShardedWrite,
    folder_of,
    is_sharded,
    load_into,
    load_trainer_state,
    rotated_folders,
)

log = logging.getLogger("trainfast")
WRITTEN, WRITING, WRITE_FAILED = 0, 1, 2  # a rank's part of a sharded checkpoint, as the ranks agree on it (the max)


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


class CheckpointWrite:
    """One checkpoint write: `last.pt` (`save_checkpoint`), then `best.pt` copied from it when `best` is given; on a
    thread of its own when `background`, else at once. `wait()` returns once it is done; its outcome is then in
    `error` (whatever the write raised), `best_written` and `write_s`."""

    def __init__(self, state: dict[str, Any], path: Path, keep: int, best: Path | None, *,
                 background: bool) -> None:
        self.path, self.best = path, best
        self.error: BaseException | None = None
        self.best_written: Path | None = None
        self.write_s = 0.0
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._write, args=(state, keep), name="trainfast-checkpoint-write")
            self._thread.start()
        else:
            self._write(state, keep)

    def _write(self, state: dict[str, Any], keep: int) -> None:
        started = time.perf_counter()
        try:
            save_checkpoint(state, self.path, keep)
            if self.best is not None:
                self.best_written = copy_best(self.path, self.best)  # a failure only warns
        except BaseException as e:  # handed to the training thread at the join, never printed by this one
            self.error = e
        finally:
            self.write_s = time.perf_counter() - started

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()


class TrainerState:
    """Capture, save and restore a `Trainer`'s whole training state (as a connector owned by its Trainer)."""

    def __init__(self, trainer: Owner) -> None:
        self.trainer = trainer
        self.saved_practices: dict[str, str] | None = None  # what the run a restored checkpoint came from chose
        self.pending: CheckpointWrite | ShardedWrite | None = None  # rank 0's write in flight (every rank's: FSDP)
        self.sharded_group: Any = None  # FSDP: the process group of the sharded writes (None: rank 0 writes .pt)
        self._sharded_writes = 0  # sharded writes started: their temporary folders' numbers, alike on every rank
        self.committing: ShardedWrite | None = None  # every rank's part written, being put in place by rank 0
        self.writing = False  # a background save was started and its outcome not yet shared (every rank alike)
        self.blocked_s: list[float] = []  # per save: seconds the training thread spent in it
        self.write_s: list[float] = []  # per save: seconds its write took (rank 0)

    def shard_checkpoints(self, group: Any) -> None:
        """From now on checkpoints are sharded folders written by every rank over `group` (a process group with a
        CPU backend: DCP's background writes run their collectives there, apart from training's)."""
        self.sharded_group = group

    def capture(self, rng_per_rank: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        t = self.trainer
        return {"model": t.model.state_dict(), "optimizer": t.optimizer.state_dict()} | self._own(rng_per_rank)

    def _own(self, rng_per_rank: list[dict[str, Any]] | None) -> dict[str, Any]:
        """The Trainer's own state: everything a checkpoint holds but the model's and the optimizer's."""
        t = self.trainer
        assert t.scheduler is not None
        rngs = rng_per_rank or [rng_state(t.device)]
        return {"scheduler": t.scheduler.state_dict(), "scaler": t.scaler.state_dict(),
                "epoch": t.epoch, "step": t.step, "batch": t.batch, "best_metric": t.best_metric,
                "epoch_loss": list(t.losses.epoch), "rng": rngs[0], "rng_per_rank": rngs,
                "config": t.config.to_dict(), "practices": t.practices.saved(), "versions": versions(),
                "format": 1}

    def save(self, path: Path) -> Path:
        """Collective under DDP: every rank calls it, rank 0 writes, all learn the outcome (see `Trainer.save`).
        Synchronous: a write in flight is waited for first, then this one is written before it returns. Returns
        the checkpoint written (under FSDP the folder `path` names: last.pt -> last.dcp)."""
        self._start(path, None, background=False)
        self.join()
        return folder_of(path) if self.sharded_group is not None else path

    def save_in_background(self, path: Path, best: Path | None) -> None:
        """`save`, but rank 0 writes on a thread while training goes on: training waits only for a write still in
        flight (`join`), the capture and the copy to host memory. `best`: where to copy `path` once written (rank 0's
        epoch improved). Collective under DDP; call `join` (every rank) before anything that needs the file."""
        self._start(path, best, background=True)

    def _start(self, path: Path, best: Path | None, *, background: bool) -> None:
        t = self.trainer
        started = time.perf_counter()
        self.join()  # at most one write in flight; a failed one raises here, on every rank
        rngs = gather(rng_state(t.device))  # each rank's RNG (its dropout stream) is part of an exact resume
        if self.sharded_group is not None:  # every rank writes its shards
            self._sharded_writes += 1
            own = to_host(self._own(rngs)) if t.dist.is_main else None  # rank 0 writes it, after its shards
            self.pending = ShardedWrite(t.model, t.optimizer, own, path, t.config.keep_checkpoints, best,
                                        number=self._sharded_writes, group=self.sharded_group, background=background)
        elif t.dist.is_main:
            state = self.capture(rngs)
            self.pending = CheckpointWrite(to_host(state) if background else state, path, t.config.keep_checkpoints,
                                           best, background=background)
        self.writing = True
        self.blocked_s.append(time.perf_counter() - started)

    def join(self) -> None:
        """Wait for the write in flight, if any, and hand its outcome to every rank (collective under DDP: every rank
        calls it at the same point): `on_checkpoint` for each file written, or the write's error raised on every
        rank (`CheckpointWriteError`: rank 0's own, the others with its message; the previous checkpoint stays)."""
        self._committed()  # a sharded checkpoint being put in place (`put_in_place`)
        if not self.writing:
            return
        self.writing = False
        if self.sharded_group is not None:
            self._join_sharded()
            return
        failed = self._wait()
        # Rank 0's outcome reaches every rank here, once its write is done (the wait a barrier gave): a failure
        # stops all ranks together instead of leaving the others waiting for a file that never comes.
        outcome = gather(None if failed is None else (isinstance(failed, CheckpointWriteError), str(failed)))[0]
        if failed is not None:
            raise failed
        if outcome is not None:
            written, message = outcome
            if written:
                raise CheckpointWriteError(message)
            raise RuntimeError(f"rank 0 could not write the checkpoint: {message}")

    def _join_sharded(self) -> None:
        """Every rank's part written? Then rank 0 renames the folder into place; every rank learns the outcome."""
        pending, self.pending = self.pending, None
        assert isinstance(pending, ShardedWrite)
        pending.wait()
        self.write_s.append(pending.write_s)
        errors = gather(None if pending.error is None else f"{type(pending.error).__name__}: {pending.error}")
        failed = next(((rank, e) for rank, e in enumerate(errors) if e is not None), None)
        if failed is not None:
            if self.trainer.dist.is_main:
                pending.discard()
            if pending.error is not None and isinstance(pending.error, CheckpointWriteError):
                raise pending.error
            rank, message = failed
            raise CheckpointWriteError(f"rank {rank} could not write its part of the sharded checkpoint "
                                       f"{str(pending.path)!r}: {message}; training stopped, the previous checkpoint "
                                       "is intact") from pending.error
        self._commit(pending)
        self._committed()

    def _commit(self, pending: ShardedWrite) -> None:
        """Every rank's part is written: rank 0 puts the folder in place on a thread (`_committed`: the outcome)."""
        if self.trainer.dist.is_main:
            pending.commit_in_background()
        self.committing = pending

    def _committed(self) -> None:
        """Collective: rank 0's commit done, its outcome on every rank (`on_checkpoint`, or `CheckpointWriteError`)."""
        committing, self.committing = self.committing, None
        if committing is None:
            return
        error = committing.wait_commit() if self.trainer.dist.is_main else None
        outcome = gather(None if error is None else str(error))[0]
        if error is not None:
            raise error
        if outcome is not None:
            raise CheckpointWriteError(outcome)
        t = self.trainer
        emit(t.callbacks, "on_checkpoint", t, committing.path)
        if committing.best_written is not None:
            emit(t.callbacks, "on_checkpoint", t, committing.best_written)

    def write_status(self) -> int:
        """This rank's part of the sharded checkpoint in flight: `WRITTEN`, `WRITING` (or none in flight) or
        `WRITE_FAILED`. It rides on the ranks' stop agreements, so the checkpoint goes in place soon after every
        rank's part is written (`put_in_place`), not at the next save."""
        if not (self.writing and isinstance(self.pending, ShardedWrite) and self.pending.done):
            return WRITING
        return WRITTEN if self.pending.error is None else WRITE_FAILED

    def put_in_place(self, failed: bool) -> None:
        """At a step where every rank agreed its part is written: rank 0 puts the folder in place on a thread, and
        the next `join` shares how that went (no collective now). Where a rank's part `failed`: `join` now, which
        raises on every rank."""
        if failed:
            self.join()
            return
        pending, self.pending = self.pending, None
        assert isinstance(pending, ShardedWrite)
        self.writing = False
        self.write_s.append(pending.write_s)
        self._commit(pending)

    def wait_here(self) -> None:
        """This rank's write in flight, if any, is finished (not collective: for a fault unwinding on this rank, which
        then names the checkpoint on disk; its outcome is still handed to every rank by `join`)."""
        if self.pending is not None:
            self.pending.wait()
        if self.committing is not None and self.trainer.dist.is_main:
            self.committing.wait_commit()

    def _wait(self) -> BaseException | None:
        """Rank 0: wait for the write in flight; `on_checkpoint` for what it wrote, or its error."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        pending.wait()
        if isinstance(pending, ShardedWrite):  # never committed without every rank's agreement: stays temporary
            return pending.error
        self.write_s.append(pending.write_s)
        if pending.error is None:
            t = self.trainer
            emit(t.callbacks, "on_checkpoint", t, pending.path)
            if pending.best_written is not None:
                emit(t.callbacks, "on_checkpoint", t, pending.best_written)
        return pending.error

    @contextmanager
    def writes_joined(self) -> Iterator[None]:
        """For `fit`'s block: the block never ends with a write in flight. On a normal end the write is joined as
        `join` does; when an exception leaves the block it is waited for on this rank only (the other ranks may be
        anywhere: no collective), and a failed write is raised in place of an `Exception` (the write failed first:
        a synchronous write would have stopped training there), or logged beside a KeyboardInterrupt or SystemExit."""
        try:
            yield
        except BaseException as e:
            self.writing = False
            failed = self._wait()
            committing, self.committing = self.committing, None
            if committing is not None and self.trainer.dist.is_main:  # its folder goes in place all the same
                failed = failed or committing.wait_commit()
            if failed is not None:
                if isinstance(e, Exception):
                    raise failed  # noqa: B904 (its __cause__ is the write's own; what it replaces, its __context__)
                log.error("%s", failed)
            raise
        self.join()

    def restore(self, resume: bool | str | Path, trusted: bool) -> None:
        """Every rank loads the checkpoint (a sharded one reshards to this run's ranks, whatever its own were)."""
        t, cfg = self.trainer, self.trainer.config
        if resume is True:
            if not cfg.checkpoint_dir:
                raise ConfigError("resume=True needs checkpoint_dir (where last.pt lives), or pass the checkpoint path")
            # Loaded on the CPU (checkpoint.py decides): load_state_dict copies into the parameters' device.
            found = self._latest_good(Path(cfg.checkpoint_dir), trusted)
            if found is None:
                log.info("resume: no checkpoint in %s yet; starting from scratch", cfg.checkpoint_dir)
                return
            path, state = found
        else:
            path = Path(resume)  # type: ignore[arg-type]
            state = self._load(path, trusted)
        assert t.scheduler is not None
        try:
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

    def _load(self, path: Path, trusted: bool) -> dict[str, Any]:
        """The checkpoint at `path` (a `.pt` file or a sharded folder), its model and optimizer state loaded into the
        Trainer's; the rest of the state returned. CheckpointError when it cannot be."""
        t = self.trainer
        if path.is_dir() or path.suffix == ".dcp":
            state = load_trainer_state(path, trusted=trusted)
            load_into(path, t.model, t.optimizer)
            return state
        state = load_checkpoint(path, trusted=trusted)
        try:
            t.model.load_state_dict(state["model"])
            t.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            hint = ("; a checkpoint written by one process or under DDP is a single file, resume it with "
                    "strategy='ddp'" if self.sharded_group is not None else "")
            raise CheckpointError(f"checkpoint {str(path)!r} does not fit this model/optimizer: {e}{hint}") from e
        return state

    def _latest_good(self, folder: Path, trusted: bool) -> tuple[Path, dict[str, Any]] | None:
        """The newest of the kept checkpoints, `.pt` files and sharded folders alike (by modification time), that
        loads; says which were skipped and why. None if there are none."""
        keep = self.trainer.config.keep_checkpoints
        candidates = [p for p in [*rotated(folder / "last.pt", keep), *rotated_folders(folder / "last.pt", keep)]
                      if p.is_file() or is_sharded(p)]
        candidates.sort(key=lambda p: os.stat(p / "trainer.pt" if p.is_dir() else p).st_mtime_ns, reverse=True)
        return first_good(candidates, lambda candidate: self._load(candidate, trusted))
