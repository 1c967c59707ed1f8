"""fit's own whole-run report (`FitResult.whole_run`, `train --json`'s `whole_run`): its wall time in the doctor's
phases, which add up to it; validation lands in `evaluation`, a blocked save in `checkpoint`, an epoch's wait for its
first batch in `epoch_start`, torch.compile's first steps in `compile`, the Trainer's own host work in `other`. And
what lifts it: an epoch's end reaches the loader (its next epoch's first batches made ahead are kept), and
`trainfast train` validates with the training loader's workers."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from helpers import blobs, make_images
from trainfast import TrainConfig, Trainer, make_loader
from trainfast.cli import main
from trainfast.cli.train import validation_workers
from trainfast.flops import Peak
from trainfast.loader.auto import LoaderPlan
from trainfast.loader.threads import ThreadLoader
from trainfast.trainer import FitResult, loop, mfu
from trainfast.trainer import state as state_module
from trainfast.trainer.phases import PHASES, compile_excess, summary_line

STEPS = 4  # per epoch: 64 blobs in batches of 16


class Slow:
    """A loader (`len` and `iter`) that sleeps `at_iter` seconds before its first batch and `per_batch` before each;
    counts the epochs it was iterated to its end."""

    def __init__(self, batches: Iterable[Any], *, at_iter: float = 0.0, per_batch: float = 0.0) -> None:
        self.batches, self.at_iter, self.per_batch = list(batches), at_iter, per_batch
        self.ended = 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        time.sleep(self.at_iter)
        for batch in self.batches:
            time.sleep(self.per_batch)
            yield batch
        self.ended += 1


@pytest.fixture(autouse=True)
def instant_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """MFU's peak without measuring it (0.2 s of set-up on a CPU otherwise)."""
    monkeypatch.setattr(mfu, "device_peak", lambda device, dtype, *, threads: Peak(1e12, "fp32", "measured: fake"))


def config(**overrides: Any) -> TrainConfig:
    """One intra-op thread: the steps' own time stays a few ms however busy the cores are (on two threads, with
    other processes on both cores, 8 steps of a Linear(8, 4) took 0.14 s, past the bound of a phase's slack)."""
    values: dict[str, Any] = {"epochs": 2, "progress": False, "device": "cpu", "precision": "32-true",
                              "channels_last": False, "compile": False, "log_every": 1, "cpu_threads": 1}
    return TrainConfig(**(values | overrides))


def data(batch: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = blobs()
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(x), batch)]


def phases(result: FitResult) -> dict[str, float]:
    assert result.whole_run is not None
    return {p["phase"]: p["seconds"] for p in result.whole_run["phases"]}


def test_the_phases_add_up_to_fits_wall_time_and_each_lands_where_it_was_spent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each epoch waits 0.1 s for its first batch, each validation pass 4 x 0.03 s, each save 0.1 s to copy the state
    to host memory: those seconds are epoch_start, evaluation and checkpoint, not training."""
    real_to_host = state_module.to_host

    def slow_to_host(state: Any) -> Any:
        time.sleep(0.1)
        return real_to_host(state)

    monkeypatch.setattr(state_module, "to_host", slow_to_host)
    torch.manual_seed(0)
    trainer = Trainer(nn.Linear(8, 4), config=config(checkpoint_dir=str(tmp_path)))
    started = time.perf_counter()
    result = trainer.fit(Slow(data(), at_iter=0.1), Slow(data(), per_batch=0.03))
    took = time.perf_counter() - started
    whole = result.whole_run
    assert whole is not None
    assert [p["phase"] for p in whole["phases"]] == list(PHASES)
    got = phases(result)
    assert sum(got.values()) == pytest.approx(whole["wall_s"], rel=0.01)
    assert whole["wall_s"] == pytest.approx(took, rel=0.01, abs=0.003) and result.wall_s == whole["wall_s"]
    assert sum(p["share"] for p in whole["phases"]) == pytest.approx(1, rel=0.01)
    assert whole["goodput"] == pytest.approx(got["train"] / whole["wall_s"])
    assert 0.2 <= got["epoch_start"] < 0.2 + 0.1
    assert 2 * 4 * 0.03 <= got["evaluation"] < 2 * 4 * 0.03 + 0.1
    assert sum(result.checkpoint_blocked_s) == pytest.approx(got["checkpoint"])
    assert 0.2 <= got["checkpoint"] < 0.2 + 0.1
    assert got["train"] < 0.15 and got["compile"] == 0 and got["startup"] < 0.1 and got["other"] < 0.1, got
    assert all(seconds >= 0 for seconds in got.values())
    assert result.to_json()["whole_run"] == whole


def test_the_wait_for_the_last_write_and_log_points_are_other(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """The last epoch's write (0.2 s here, in the background) is waited for before fit ends; a callback at each log
    point (0.02 s) is host work inside the epoch's span: both are `other`, not training nor a blocked save."""
    real_save = state_module.save_checkpoint

    def slow_save(state: dict[str, Any], path: Path, keep: int) -> Path:
        time.sleep(0.2)
        return real_save(state, path, keep)

    class SlowLog:
        def on_log(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
            time.sleep(0.02)

    monkeypatch.setattr(state_module, "save_checkpoint", slow_save)
    torch.manual_seed(0)
    result = Trainer(nn.Linear(8, 4), config=config(epochs=1, checkpoint_dir=str(tmp_path)),
                     callbacks=(SlowLog(),)).fit(data())
    got = phases(result)
    assert 0.2 + STEPS * 0.02 <= got["other"] < 0.2 + STEPS * 0.02 + 0.1, got
    assert got["checkpoint"] < 0.05 and got["train"] < 0.1, got


def test_the_mfu_peak_measured_inside_the_loop_is_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """With an A/B running the peak is taken when it settles, inside a step: its 0.3 s is the Trainer's own work."""
    def slow_peak(device: torch.device, dtype: torch.dtype, *, threads: int) -> Peak:
        time.sleep(0.3)
        return Peak(1e12, "fp32", "measured: fake")

    monkeypatch.setattr(mfu, "device_peak", slow_peak)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 6 * 6, 4))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(30 * 16, 3, 6, 6, generator=g), torch.randint(0, 4, (30 * 16,), generator=g)
    result = Trainer(model, config=config(epochs=1, channels_last="auto", log_every=50)).fit(
        make_loader((x, y), 16, shuffle=False))
    assert result.channels_last is not None and result.channels_last["measured"] is True  # the A/B ran
    got = phases(result)
    assert got["other"] >= 0.3 and got["train"] < result.whole_run["wall_s"] - 0.3, got  # type: ignore[index]


def test_compiling_steps_are_compile_not_train(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step during which torch.compile compiled frames (faked: the counter moves, the forward takes 0.3 s longer)
    is `compile` beyond the median step; the other steps stay training. (Beyond the median: the sleep less the
    median step's own time, 0.296 s once on a busy machine, hence the bound below 0.3.)"""
    frames = {"n": 0}

    class CompilesOnce(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if frames["n"] == 0:
                time.sleep(0.3)
                frames["n"] = 1
            return super().forward(x)

    monkeypatch.setattr(loop, "dynamo_counts", lambda: {"frames": frames["n"], "graph_breaks": 0})
    torch.manual_seed(0)
    result = Trainer(CompilesOnce(8, 4), config=config(epochs=1)).fit(data())
    got = phases(result)
    assert 0.27 <= got["compile"] < 0.4 and got["train"] < 0.1, got


def test_compile_excess_is_the_compiling_steps_excess_over_the_median() -> None:
    steps, waits = [1.0, 0.12, 0.3, 0.1, 0.1, 0.1], [0.0, 0.0, 0.2, 0.0, 0.0, 0.0]
    assert compile_excess(steps, waits, [0], warmup=3) == pytest.approx(0.9)  # median of steps 3-5: 0.1
    assert compile_excess(steps, waits, [], warmup=3) == 0
    assert compile_excess([1.0], [0.0], [0], warmup=3) == 0  # nothing to compare with
    assert compile_excess([1.0, 0.2], [0.0, 0.0], [0], warmup=3) == pytest.approx(0.8)  # short: the other steps


def test_the_summary_line_names_each_phase_other_than_training_largest_first() -> None:
    shares = {"startup": 0.004, "compile": 0.0, "train": 0.934, "evaluation": 0.05, "checkpoint": 0.002,
              "epoch_start": 0.01, "other": 0.0}
    whole = {"wall_s": 12.06, "goodput": 0.934,
             "phases": [{"phase": p, "seconds": s * 12.06, "share": s} for p, s in shares.items()]}
    assert summary_line(whole) == ("whole run: 12.1 s, goodput 93.4 % (validation 5 %, epoch starts 1 %, set-up 0.4 %, "
                                   "checkpoints 0.2 %)")


def test_an_epochs_end_reaches_the_loader_unless_the_epoch_is_cut_short() -> None:
    """After an epoch's last batch the loop asks once more, as a `for` loop would; with limit_batches it does not
    (that would load a batch it never uses)."""
    torch.manual_seed(0)
    whole = Slow(data())
    Trainer(nn.Linear(8, 4), config=config()).fit(whole)
    assert whole.ended == 2
    cut = Slow(data())
    Trainer(nn.Linear(8, 4), config=config(limit_batches=STEPS - 1)).fit(cut)
    assert cut.ended == 0


def test_a_thread_loader_keeps_the_next_epochs_first_batches_made_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each epoch after the first begins with the threads the last one handed over (no wait for a first batch)."""
    handed: list[bool] = []
    real_iter = ThreadLoader.__iter__

    def spy(self: ThreadLoader) -> Iterator[Any]:
        handed.append(self._ahead is not None)
        return real_iter(self)

    monkeypatch.setattr(ThreadLoader, "__iter__", spy)
    x, y = blobs()
    loader = make_loader((x, y), 16, shuffle=True, workers=1, backend="threads")
    assert isinstance(loader, ThreadLoader)
    torch.manual_seed(0)
    Trainer(nn.Linear(8, 4), config=config(epochs=3)).fit(loader)
    assert handed == [False, True, True]


def plan(workers: int, backend: str = "processes") -> LoaderPlan:
    return LoaderPlan(num_workers=workers, pin_memory=False, persistent_workers=workers > 0, prefetch_factor=2,
                      drop_last=True, in_memory=False, reasons=(), backend=backend)


def test_train_validates_with_the_training_loaders_workers() -> None:
    assert validation_workers("auto", plan(3), 400, 64, 1) == {"workers": 3, "backend": "processes"}
    assert validation_workers("auto", plan(3), 100, 64, 1) == {"workers": 2, "backend": "processes"}  # 2 batches
    assert validation_workers("tuned", plan(2, "threads"), 400, 64, 1) == {"workers": 2, "backend": "threads"}
    assert validation_workers("auto", plan(0), 400, 64, 1) == {"workers": 0, "backend": "processes"}
    assert validation_workers("auto", plan(4), 400, 64, 4) == {"workers": 2, "backend": "processes"}  # per rank
    assert validation_workers(5, plan(1), 400, 64, 1) == {"workers": 5}  # as given
    assert validation_workers("auto", None, 400, 64, 1) == {"workers": "auto"}


def test_train_prints_the_whole_run_and_writes_it_to_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_images(tmp_path / "data", train=4, val=2)
    out = tmp_path / "run.json"
    assert main(["train", "--data", str(root), "--epochs", "1", "--image-size", "16", "--batch-size", "2",
                 "--device", "cpu", "--precision", "32-true", "--no-progress", "--workers", "0",
                 "--json", str(out)]) == 0
    whole = json.loads(out.read_text())["whole_run"]
    assert set(whole) == {"wall_s", "goodput", "phases"}
    assert [p["phase"] for p in whole["phases"]] == list(PHASES)
    assert sum(p["seconds"] for p in whole["phases"]) == pytest.approx(whole["wall_s"], rel=0.01)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"whole run: {whole['wall_s']:.1f} s, goodput ") and "validation" in last, last
