"""fit's end-of-epoch checkpoints are written in the background: training waits only for the capture and the copy to
host memory while a thread writes last.pt (and best.pt); the next save, the end of fit, a stop signal or an exception
waits for the write in flight, and a failed write raises `CheckpointWriteError` there with the previous checkpoint
intact. Files are the same as a synchronous write's: the state as it was at the save, whatever training did since."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import blobs
from trainfast import TrainConfig, Trainer, make_loader
from trainfast.trainer import CheckpointWriteError, FitResult, NonFiniteLossError, load_checkpoint
from trainfast.trainer import state as state_module
from trainfast.trainer.checkpoint import to_host

STEPS = 4  # per epoch: 64 blobs in batches of 16
WAIT_S = 10.0  # a held write gives up after this: training never reached the point it waits for


def fit(tmp_path: Path, epochs: int = 2, *, callbacks: tuple[object, ...] = (), resume: bool = False,
        val: bool = False, **overrides: Any) -> tuple[Trainer, FitResult]:
    x, y = blobs()
    torch.manual_seed(0)
    config = TrainConfig(epochs=epochs, checkpoint_dir=str(tmp_path), progress=False, device="cpu",
                         precision="32-true", channels_last=False, log_every=1, **overrides)
    trainer = Trainer(nn.Linear(8, 4), config=config, callbacks=callbacks)
    result = trainer.fit(make_loader((x, y), 16, shuffle=False),
                         make_loader((x, y), 64, shuffle=False) if val else None, resume=resume)
    return trainer, result


class HeldWrites:
    """`save_checkpoint` as the Trainer's writer thread calls it, each write held until `release` is set (or for
    `sleep_s`); records the steps training took while a write was held."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, sleep_s: float = 0.0, fail: bool = False) -> None:
        self.real = state_module.save_checkpoint
        self.release = threading.Event()
        self.sleep_s, self.fail = sleep_s, fail
        self.held = threading.Event()  # a write is being held now
        self.threads: list[str] = []
        self.steps_while_held: list[int] = []
        monkeypatch.setattr(state_module, "save_checkpoint", self.save)

    def save(self, state: dict[str, Any], path: Path, keep: int) -> Path:
        self.threads.append(threading.current_thread().name)
        self.held.set()
        try:
            if self.sleep_s:
                time.sleep(self.sleep_s)
            else:
                assert self.release.wait(WAIT_S), "training did not go on while the checkpoint was written"
            if self.fail:
                raise CheckpointWriteError(f"could not write checkpoint {str(path)!r}: the test's full disk")
            return self.real(state, path, keep)
        finally:
            self.held.clear()

    def on_log(self, trainer: Trainer, metrics: dict[str, Any]) -> None:  # a callback: steps while held
        if self.held.is_set():
            self.steps_while_held.append(metrics["step"])


class ReleaseAt:
    """Releases the held write at an optimizer step (log_every=1)."""

    def __init__(self, writes: HeldWrites, step: int) -> None:
        self.writes, self.step = writes, step

    def on_log(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if metrics["step"] >= self.step:
            self.writes.release.set()


def test_a_write_in_flight_does_not_block_the_next_epoch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Epoch 1's write is held until epoch 2 has taken 2 steps: they happen while it is in flight; the write runs on
    its own thread, last.pt is epoch 1's until epoch 2's save and epoch 2's once fit returns."""
    writes = HeldWrites(monkeypatch)
    events: list[str] = []

    class Events:
        def on_checkpoint(self, trainer: Trainer, path: Path) -> None:
            events.append(f"checkpoint {trainer.epoch}")

        def on_epoch_end(self, trainer: Trainer, epoch: int, metrics: dict[str, float]) -> None:
            events.append(f"epoch_end {epoch + 1}")

    trainer, result = fit(tmp_path, callbacks=(writes, ReleaseAt(writes, STEPS + 2), Events()))
    assert writes.steps_while_held[:2] == [STEPS + 1, STEPS + 2]
    assert writes.threads == ["trainfast-checkpoint-write"] * 2
    assert load_checkpoint(tmp_path / "last.pt")["step"] == trainer.step == 2 * STEPS
    assert load_checkpoint(tmp_path / "last.1.pt")["step"] == STEPS
    # epoch 1's file is on disk when epoch 2's save joins it; the last epoch's write is waited for before its end
    assert events == ["epoch_end 1", "checkpoint 2", "checkpoint 2", "epoch_end 2"]
    assert len(result.checkpoint_blocked_s) == len(result.checkpoint_write_s) == 2
    # (the write, held for 2 steps of ~1 ms, and the capture + copy both take a few ms: which is longer is noise)
    assert result.checkpoint_write_s[0] > 0 and result.checkpoint_blocked_s[0] > 0
    assert result.to_json()["checkpoint_blocked_s"] == result.checkpoint_blocked_s


def test_a_failed_background_write_raises_at_the_join_and_keeps_the_previous(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full_volume: Any) -> None:
    fit(tmp_path, epochs=1)
    before = (tmp_path / "last.pt").read_bytes()
    full_volume.torch_save_from(1)  # the disk is full from here on: epoch 2's write fails on its thread
    trained: list[int] = []

    class Steps:
        def on_log(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
            trained.append(metrics["step"])

    with pytest.raises(CheckpointWriteError) as info:
        fit(tmp_path, epochs=3, resume=True, callbacks=(Steps(),))
    assert trained == list(range(STEPS + 1, 3 * STEPS + 1))  # epoch 3 trained: the failure came at its save
    last = tmp_path / "last.pt"
    assert str(info.value).startswith(f"could not write checkpoint {str(last)!r}: No space left on device")
    assert f"the last intact checkpoint is {str(last)!r}: resume from it" in str(info.value)
    assert isinstance(info.value.__cause__, OSError)  # the write's own cause, kept across the thread
    assert last.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]
    full_volume.monkeypatch.undo()
    assert fit(tmp_path, epochs=3, resume=True)[0].epoch == 3  # room again: resume goes on from epoch 1


def test_fit_returns_only_after_the_last_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writes = HeldWrites(monkeypatch, sleep_s=0.3)
    _, result = fit(tmp_path, epochs=2, val=True)
    assert result.checkpoint == str(tmp_path / "last.pt") and result.best_checkpoint == str(tmp_path / "best.pt")
    assert load_checkpoint(tmp_path / "last.pt")["epoch"] == 2
    assert not writes.held.is_set() and min(result.checkpoint_write_s) >= 0.3
    assert result.checkpoint_blocked_s[0] < 0.3  # epoch 1's save did not wait for its write


def test_the_written_state_is_the_one_captured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parameters, moments and step counters change while epoch 1's write is held: its file holds them as they
    were at the save."""
    writes = HeldWrites(monkeypatch)
    at_save: dict[str, torch.Tensor] = {}

    class Snapshot:
        def on_epoch_end(self, trainer: Trainer, epoch: int, metrics: dict[str, float]) -> None:
            if epoch == 0:
                at_save.update({k: v.clone() for k, v in trainer.model.state_dict().items()})
                at_save["exp_avg"] = trainer.optimizer.state[trainer.model.weight]["exp_avg"].clone()
                at_save["step"] = trainer.optimizer.state[trainer.model.weight]["step"].clone()

    trainer, _ = fit(tmp_path, callbacks=(Snapshot(), ReleaseAt(writes, 2 * STEPS)))
    saved = load_checkpoint(tmp_path / "last.1.pt")  # epoch 1's, written after epoch 2 had trained
    assert saved["step"] == STEPS
    for key in ("weight", "bias"):
        assert torch.equal(saved["model"][key], at_save[key]), key
        assert not torch.equal(saved["model"][key], trainer.model.state_dict()[key]), key
    assert torch.equal(saved["optimizer"]["state"][0]["exp_avg"], at_save["exp_avg"])
    assert int(saved["optimizer"]["state"][0]["step"]) == int(at_save["step"]) == STEPS


def test_a_stop_signal_waits_for_the_write_in_flight_then_saves_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop_at: Callable[[int], object]) -> None:
    writes = HeldWrites(monkeypatch)
    with pytest.raises(SystemExit) as stopped:
        fit(tmp_path, epochs=3, callbacks=(writes, ReleaseAt(writes, STEPS + 2), stop_at(STEPS + 2)))
    assert stopped.value.code == 143
    assert writes.steps_while_held == [STEPS + 1, STEPS + 2]
    assert writes.threads == ["trainfast-checkpoint-write", "MainThread"]  # the stop's save: synchronous
    assert load_checkpoint(tmp_path / "last.pt")["step"] == STEPS + 2
    assert load_checkpoint(tmp_path / "last.1.pt")["step"] == STEPS


@pytest.mark.parametrize("write", ["written", "failed"])
def test_an_exception_leaving_fit_waits_for_the_write_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               write: str) -> None:
    """A non-finite loss in epoch 2 while epoch 1's write is in flight: fit waits for it; a write that failed is
    raised instead (it failed first: a synchronous write would have stopped training there)."""
    writes = HeldWrites(monkeypatch, sleep_s=0.3, fail=write == "failed")
    calls = [0]

    def poisoned(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        loss = F.cross_entropy(out, target)
        return loss * float("nan") if calls[0] > STEPS else loss

    x, y = blobs()
    config = TrainConfig(epochs=3, checkpoint_dir=str(tmp_path), progress=False, device="cpu", precision="32-true",
                         channels_last=False, log_every=1)
    trainer = Trainer(nn.Linear(8, 4), loss_fn=poisoned, config=config)
    expected = NonFiniteLossError if write == "written" else CheckpointWriteError
    with pytest.raises(expected) as info:
        trainer.fit(make_loader((x, y), 16, shuffle=False))
    assert not writes.held.is_set() and trainer.step == STEPS + 1
    if write == "written":
        assert load_checkpoint(tmp_path / "last.pt")["step"] == STEPS
    else:
        assert isinstance(info.value.__context__, NonFiniteLossError)
        assert not (tmp_path / "last.pt").exists()


def test_the_host_copy_keeps_sharing_and_layouts_and_owns_its_memory() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4, 4), nn.Linear(4, 4))
    model[3].weight = model[2].weight  # tied
    model.to(memory_format=torch.channels_last)
    rng = {"torch": torch.get_rng_state()}
    state = {"model": model.state_dict(), "rng": rng, "rng_per_rank": [rng], "step": 3, "pair": (1, [2.0])}
    host = to_host(state)
    weights = host["model"]
    assert hasattr(weights, "_metadata")  # load_state_dict's versions, as torch.save would keep them
    assert weights["2.weight"].untyped_storage().data_ptr() == weights["3.weight"].untyped_storage().data_ptr()
    assert weights["0.weight"].is_contiguous(memory_format=torch.channels_last)
    assert host["rng_per_rank"][0] is host["rng"] and host["pair"] == (1, [2.0]) and host["step"] == 3
    for key, value in state["model"].items():
        assert torch.equal(weights[key], value)
        assert weights[key].untyped_storage().data_ptr() != value.untyped_storage().data_ptr()
    with torch.no_grad():
        model[0].weight.add_(1)
    assert not torch.equal(weights["0.weight"], model[0].weight)
