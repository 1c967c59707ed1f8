"""Checkpoints of a sharded (FSDP) model: a folder per checkpoint written by every rank through
`torch.distributed.checkpoint` (DCP), complete on every rank or not at all.

A checkpoint `last.dcp/` holds DCP's files (each rank's shards of the model and the optimizer, `.metadata`) and
`trainer.pt`, the Trainer's own state (step, position, schedule, scaler, RNG of every rank, ...; `load_checkpoint`
verifies it like a `.pt` checkpoint). Every rank writes its shards into a temporary folder beside it
(`.trainfast-dcp-...`): `dcp.async_save` returns once the state is staged in host memory and writes on a thread
while training goes on. Only once every rank's write has finished, agreed by a collective at the next save or at the
end of fit (`TrainerState.join`), does rank 0 rotate the kept checkpoints (`last.dcp` -> `last.1.dcp`) and rename the
folder into place. A crash mid-write leaves the temporary folder, removed at the next start, and the previous
`last.dcp` intact.

DCP reshards on load: a checkpoint saved at 2 ranks resumes at 1 (a plain model), at 2 or at more, under FSDP or
DDP (`load_into`).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from trainfast.atomic import TEMP_PREFIX, as_write_failure
from trainfast.trainer.checkpoint import (
    CheckpointError,
    CheckpointWriteError,
    atomic_save,
    load_checkpoint,
    rotate,
    rotated,
    to_host,
    unrotate,
)
from trainfast.trainer.distributed import dist_initialized

if TYPE_CHECKING:
    from torch.distributed.checkpoint.staging import AsyncStager

log = logging.getLogger("trainfast")
SUFFIX = ".dcp"
TRAINER_FILE = "trainer.pt"  # the Trainer's own state, beside DCP's files
TEMP_DIR_PREFIX = f"{TEMP_PREFIX}dcp-"
SHARDED = "sharded: torch.distributed.checkpoint files beside this one"  # trainer.pt's "model" entry


def folder_of(path: Path) -> Path:
    """The sharded checkpoint's folder for a checkpoint path: last.pt -> last.dcp."""
    return path.with_suffix(SUFFIX)


def rotated_folders(path: Path, keep: int) -> list[Path]:
    """`last.dcp`, `last.1.dcp`, ...: newest first."""
    return rotated(folder_of(path), keep)


def is_sharded(path: Path) -> bool:
    return path.is_dir() and (path / TRAINER_FILE).is_file()


def clean_stale_folders(folder: Path) -> list[Path]:
    """Remove the temporary folders of writes that never completed (a process killed mid-write)."""
    removed = [stale for stale in folder.glob(f"{TEMP_DIR_PREFIX}*") if stale.is_dir()] if folder.is_dir() else []
    for stale in removed:
        shutil.rmtree(stale, ignore_errors=True)
    if removed:
        log.info("removed %d unfinished sharded checkpoint write(s) from %s", len(removed), folder)
    return removed


def dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's and optimizer's state as DCP saves and loads it (each rank's own shards, keyed by name)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


class ShardedWrite:
    """This rank's part of one sharded checkpoint: its shards into a temporary folder (DCP, on a thread when
    `background`) and, on rank 0, `trainer.pt`. `wait()` returns once this rank's part is written (its outcome in
    `error`); `commit()` (rank 0, once every rank's part is written) renames the folder into place."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict[str, Any] | None,
                 path: Path, keep: int, best: Path | None, *, number: int, group: Any, background: bool) -> None:
        from torch.distributed.checkpoint.state_dict_saver import async_save, save
        self.path, self.keep, self.best = folder_of(path), keep, folder_of(best) if best is not None else None
        self.temp = self.path.with_name(f"{TEMP_DIR_PREFIX}{self.path.name}-{number}")
        self.error: BaseException | None = None
        self.best_written: Path | None = None
        self.write_s = 0.0
        self._started = time.perf_counter()
        self._trainer_state = trainer_state
        self._done = threading.Event()  # this rank's part written (or failed)
        try:
            state = dcp_state(model, optimizer)
            if background:  # returns once the state is staged in host memory (a blocking copy)
                # On the CPU `to_host` stages it, DCP's stager then copies nothing: DCP's own copy took 1.5x as long
                # here (15-30 ms vs 9-17 ms for 48 MiB of shards, benchmarks/fsdp_memory.py); from a GPU its stager
                # makes the device-to-host copy.
                on_cpu = all(p.device.type == "cpu" for p in model.parameters())
                future = cast(Future[Any], async_save(to_host(state) if on_cpu else state, checkpoint_id=self.temp,
                                                      process_group=group, no_dist=group is None,
                                                      async_stager=_staged() if on_cpu else None))
                future.add_done_callback(self._written)
            else:
                with _alone_said():
                    save(state, checkpoint_id=self.temp, process_group=group, no_dist=group is None)
                self._finish(None)
        except Exception as e:  # every rank reaches the agreement in `TrainerState.join` with it
            self._finish(e)

    def _written(self, future: Future[Any]) -> None:
        """On DCP's writer thread, its write done: then rank 0's `trainer.pt` (a few KiB; its fsync is kept off the
        training thread)."""
        self._finish(future.exception())

    def _finish(self, error: BaseException | None) -> None:
        try:
            if error is None and self._trainer_state is not None:
                atomic_save(self._trainer_state | {"model": SHARDED}, self.temp / TRAINER_FILE)
        except BaseException as e:  # handed to every rank at the join
            error = e
        self.error = error
        self.write_s = time.perf_counter() - self._started
        self._done.set()

    def wait(self) -> None:
        self._done.wait()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def commit(self) -> None:
        """Rank 0, once every rank's part is written: rotate the kept checkpoints, rename the folder into place,
        link best's files to it. A failure leaves the previous checkpoint as the newest (`CheckpointWriteError`)."""
        names = rotated_folders(self.path, self.keep)
        trash = self.path.with_name(f"{TEMP_DIR_PREFIX}{self.path.name}-{self.temp.name}-dropped")
        try:
            if names[-1].exists():  # the oldest kept goes (a folder cannot be renamed over); deleted on a thread
                names[-1].replace(trash)
            rotate(self.path, self.keep)
            self.temp.replace(self.path)
            _fsync_dir(self.path.parent)
        except OSError as e:
            shutil.rmtree(self.temp, ignore_errors=True)
            unrotate(self.path, self.keep)  # the newest kept back in place
            raise CheckpointWriteError(f"could not put the sharded checkpoint in place at {str(self.path)!r}: "
                                       f"{as_write_failure(e).reason}; training stopped, the newest intact "
                                       "checkpoint is kept") from e
        if self.best is not None:
            self.best_written = copy_best_folder(self.path, self.best)
        _delete_behind(trash)

    def commit_in_background(self) -> None:
        """`commit` on a thread (rank 0): every rank waits for nothing; `wait_commit` gives its outcome."""
        self._commit_error: BaseException | None = None
        self._committer = threading.Thread(target=self._commit_here, name="trainfast-checkpoint-commit")
        self._committer.start()

    def _commit_here(self) -> None:
        try:
            self.commit()
        except BaseException as e:  # handed to every rank at the next join
            self._commit_error = e

    def wait_commit(self) -> BaseException | None:
        self._committer.join()
        return self._commit_error

    def discard(self) -> None:
        """Rank 0: a write that failed on some rank never becomes a checkpoint."""
        shutil.rmtree(self.temp, ignore_errors=True)


def copy_best_folder(last: Path, best: Path) -> Path | None:
    """`best.dcp` as hard links to the files of the just-committed `last.dcp` (never modified in place: no copy
    needed), swapped in by renames. A failure only warns: the run goes on with the previous best."""
    temp = best.with_name(f"{TEMP_DIR_PREFIX}{best.name}")
    old = best.with_name(f"{TEMP_DIR_PREFIX}{best.name}.old-{time.time_ns()}")  # the previous may be being deleted
    try:
        shutil.rmtree(temp, ignore_errors=True)
        shutil.copytree(last, temp, copy_function=_link_or_copy)
        if best.exists():
            best.replace(old)
        temp.replace(best)
        _delete_behind(old)
        return best
    except OSError as e:
        shutil.rmtree(temp, ignore_errors=True)
        log.warning("could not write %s (%s); training goes on, %s (the resume point) is intact", best,
                    as_write_failure(e).reason, last)
        return None


@functools.cache
def _staged() -> AsyncStager:
    """A stager for a state already copied to host memory (`to_host`): nothing left to copy. (Made on first use:
    importing DCP's staging costs every start of trainfast ~1 s otherwise.)"""
    from torch.distributed.checkpoint.staging import AsyncStager

    class Staged(AsyncStager):
        @property
        def should_synchronize_after_execute(self) -> bool:
            return False

        def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            return state_dict

        def synchronize_staging(self) -> None:
            pass

        def close(self) -> None:
            pass

    return Staged()


def _delete_behind(folder: Path) -> None:
    """Delete `folder` on a thread: a checkpoint's files take long to unlink (every rank waits for rank 0's commit,
    ~0.1 s for a 96 MiB one here), and a folder left by an exit is a temporary one, removed at the next start."""
    if folder.exists():
        threading.Thread(target=shutil.rmtree, args=(folder,), kwargs={"ignore_errors": True},
                         name="trainfast-checkpoint-delete", daemon=True).start()


@contextmanager
def _alone_said() -> Iterator[None]:
    """DCP in one process warns that it assumes one process, even when told so (`no_dist=True`): that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_trainer_state(path: Path, trusted: bool = False) -> dict[str, Any]:
    """The Trainer's own state of the sharded checkpoint `path` (verified as `load_checkpoint` does)."""
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"sharded checkpoint {str(path)!r} has no .metadata: its write never finished")
    return load_checkpoint(path / TRAINER_FILE, trusted=trusted)


def load_into(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the model's and optimizer's shards of `path` into `model` and `optimizer`, resharded to this run (every
    rank calls it: FSDP, DDP, or one process without a process group)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load
    state = dcp_state(model, optimizer)
    try:
        with _alone_said():
            load(state, checkpoint_id=path, no_dist=not dist_initialized())
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    except Exception as e:
        raise CheckpointError(f"sharded checkpoint {str(path)!r} cannot be loaded into this model/optimizer: "
                              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
