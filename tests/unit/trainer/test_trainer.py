"""Trainer behaviour on CPU with tiny models: learning, no host sync in the step, accumulation, clipping order,
bit-exact resume after a stop mid-epoch, SIGTERM, non-finite loss, callbacks and global settings."""

from __future__ import annotations

import hashlib
import math
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import blobs
from trainfast import TrainConfig, Trainer, make_loader
from trainfast.data.images import ImageFolder
from trainfast.loader.seeding import seed_all
from trainfast.trainer import CheckpointError, ConfigError, NonFiniteLossError, load_checkpoint


def tiny_mlp(in_features: int = 3 * 16 * 16, dropout: float = 0.2) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, 32), nn.Dropout(dropout), nn.GELU(), nn.Linear(32, 10))


def config(**overrides: Any) -> TrainConfig:
    values: dict[str, Any] = {"epochs": 2, "progress": False, "warmup_steps": 2, "device": "cpu"}
    return TrainConfig(**(values | overrides))


def test_fit_learns_and_reports() -> None:
    x, y = blobs(n=256)
    seed_all(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    train = make_loader((x, y), 32)
    val = make_loader((x, y), 64, shuffle=False)
    result = Trainer(model, config=config(epochs=5, lr=1e-2)).fit(train, val)
    assert result.epochs == 5 and result.steps == 5 * 8
    assert result.val_accuracy is not None and result.val_accuracy > 0.9
    assert result.final_loss is not None and result.final_loss < 0.5
    assert result.samples_per_s > 0 and 0 <= result.data_wait_fraction < 1
    assert set(result.to_json()) >= {"epochs", "steps", "samples_per_s", "data_wait_fraction", "final_loss",
                                     "val_accuracy", "checkpoint"}


def test_no_host_sync_inside_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only log points and epoch ends read from the device; 20 steps with log_every=1000 read once."""
    syncs: list[str] = []

    def counting(name: str) -> Any:
        original = getattr(torch.Tensor, name)

        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if sys._getframe(1).f_globals.get("__name__", "").startswith("trainfast"):
                syncs.append(name)
            return original(self, *args, **kwargs)
        return wrapper

    for name in ("item", "tolist", "numpy", "__float__", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    x, y = blobs(n=320)
    trainer = Trainer(nn.Linear(8, 4), config=config(epochs=1, log_every=1000))
    trainer.fit(make_loader((x, y), 16))
    assert trainer.step == 20
    assert syncs == ["item"]  # the epoch-end read of the summed loss


def test_accumulation_matches_a_larger_batch() -> None:
    x, y = blobs(n=160)
    results = []
    for batch, accumulate in ((16, 1), (8, 2)):
        seed_all(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        trainer = Trainer(model, config=config(epochs=1, accumulate=accumulate, grad_clip=None,
                                                  precision="32-true"))  # bf16 rounds the two differently
        trainer.fit(make_loader((x, y), batch, shuffle=False))
        assert trainer.step == 10
        results.append(model.state_dict())
    for key in results[0]:
        torch.testing.assert_close(results[0][key], results[1][key], rtol=0, atol=1e-6)


def test_clipping_happens_after_unscale(monkeypatch: pytest.MonkeyPatch) -> None:
    """With fp16 loss scaling (65536x), clipping before unscale_ would see gigantic norms."""
    from trainfast.precision.policy import LossScaler

    events: list[str] = []
    unscale = LossScaler.unscale_
    clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(LossScaler, "unscale_", lambda self, opt: (events.append("unscale"), unscale(self, opt))[1])

    def spy_clip(params: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
        params = list(params)
        norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in params]))
        events.append(f"clip {float(norm):.0f}")
        return clip(params, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy_clip)
    x, y = blobs(n=64)
    trainer = Trainer(nn.Linear(8, 4), config=config(epochs=1, precision="16-mixed", grad_clip=1.0))
    assert trainer.scaler.enabled
    trainer.fit(make_loader((x, y), 16))
    assert events[0] == "unscale" and events[1].startswith("clip")
    norms = [float(e.split()[1]) for e in events if e.startswith("clip")]
    finite = [n for n in norms if math.isfinite(n)]  # the first steps overflow until the scale backs off
    assert finite and max(finite) < 1000


def _image_run(tiny_images: Path, ckpt: Path | None, *, workers: int, callbacks: tuple[object, ...] = (),
               resume: bool = False, epochs: int = 2) -> Trainer:
    seed_all(0)
    model = tiny_mlp()
    loader = make_loader(ImageFolder(tiny_images / "train", image_size=16), 8, workers=workers, seed=3)
    val = make_loader(ImageFolder(tiny_images / "val", image_size=16, train=False), 20, shuffle=False)
    trainer = Trainer(model, config=config(epochs=epochs, log_every=1, checkpoint_dir=str(ckpt) if ckpt else None),
                      callbacks=callbacks)
    trainer.fit(loader, val, resume=resume)
    return trainer


@pytest.mark.parametrize("stop_step", [4, 13])  # mid first epoch, mid second epoch (10 batches per epoch)
@pytest.mark.slow
def test_resume_after_sigterm_is_bit_exact(tiny_images: Path, tmp_path: Path, stop_step: int,
                                           stop_at: Callable[[int], object]) -> None:
    reference = _image_run(tiny_images, None, workers=2)
    with pytest.raises(SystemExit) as stopped:
        _image_run(tiny_images, tmp_path, workers=2, callbacks=(stop_at(stop_step),))
    assert stopped.value.code == 143
    saved = load_checkpoint(tmp_path / "last.pt")
    assert (saved["step"], saved["epoch"], saved["batch"]) == (stop_step, stop_step // 10, stop_step % 10)
    resumed = _image_run(tiny_images, tmp_path, workers=2, resume=True)
    assert resumed.step == reference.step == 20
    for key, value in reference.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[key]), key


def test_results_do_not_depend_on_worker_count(tiny_images: Path) -> None:
    a = _image_run(tiny_images, None, workers=0, epochs=1)
    b = _image_run(tiny_images, None, workers=2, epochs=1)
    for key, value in a.model.state_dict().items():
        assert torch.equal(value, b.model.state_dict()[key]), key


def test_checkpoints_hold_the_contract_keys(tiny_images: Path, tmp_path: Path) -> None:
    trainer = _image_run(tiny_images, tmp_path, workers=0, epochs=1)
    for name in ("last.pt", "best.pt"):
        state = torch.load(tmp_path / name, weights_only=True)
        assert {"model", "optimizer", "scheduler", "scaler", "epoch", "step", "rng", "config", "versions"} <= set(state)
        assert state["epoch"] == 1 and state["batch"] == 0 and state["step"] == trainer.step
        assert {"torch", "numpy", "python", "cuda"} <= set(state["rng"])
        assert state["config"]["epochs"] == 1


def test_non_finite_loss_stops_and_keeps_the_good_checkpoint(tmp_path: Path) -> None:
    x, y = blobs(n=64)
    calls = {"train": 0}

    def poisoned(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(out, target)
        if torch.is_grad_enabled():
            calls["train"] += 1
            if calls["train"] > 6:  # epoch 2 (4 batches per epoch) goes bad
                return loss * float("nan")
        return loss

    trainer = Trainer(nn.Linear(8, 4), loss_fn=poisoned, config=config(epochs=3, checkpoint_dir=str(tmp_path)))
    train, val = make_loader((x, y), 16), make_loader((x, y), 32, shuffle=False)
    with pytest.raises(NonFiniteLossError, match=r"non-finite .*no checkpoint was written after it.*last.pt"):
        trainer.fit(train, val)
    assert load_checkpoint(tmp_path / "last.pt")["epoch"] == 1  # the epoch-1 checkpoint, untouched
    digest = hashlib.sha256((tmp_path / "last.pt").read_bytes()).hexdigest()
    assert digest == hashlib.sha256((tmp_path / "last.pt").read_bytes()).hexdigest()


def test_sigterm_without_checkpoint_dir_still_exits_143(stop_at: Callable[[int], object]) -> None:
    x, y = blobs(n=64)
    trainer = Trainer(nn.Linear(8, 4), config=config(epochs=1, log_every=1), callbacks=(stop_at(2),))
    with pytest.raises(SystemExit) as stopped:
        trainer.fit(make_loader((x, y), 16))
    assert stopped.value.code == 143 and trainer.step == 2
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler put back


class Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []
        self.threads_inside: int | None = None

    def on_fit_start(self, trainer: Trainer) -> None:
        self.events.append("fit_start")
        self.threads_inside = torch.get_num_threads()

    def on_epoch_start(self, trainer: Trainer, epoch: int) -> None:
        self.events.append(f"epoch_start {epoch}")

    def on_log(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        self.events.append(f"log {metrics['step']}")

    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self.events.append("validation_end")

    def on_checkpoint(self, trainer: Trainer, path: Path) -> None:
        self.events.append(f"checkpoint {Path(path).name}")

    def on_epoch_end(self, trainer: Trainer, epoch: int, metrics: dict[str, float]) -> None:
        self.events.append(f"epoch_end {epoch}")

    def on_fit_end(self, trainer: Trainer, result: object) -> None:
        self.events.append("fit_end")


def test_callback_events_and_thread_setting_restored(tmp_path: Path) -> None:
    x, y = blobs(n=64)
    recorder = Recorder()
    threads = torch.get_num_threads()
    cfg = config(epochs=1, log_every=2, cpu_threads=1, checkpoint_dir=str(tmp_path))
    trainer = Trainer(nn.Linear(8, 4), config=cfg, callbacks=[recorder])
    trainer.fit(make_loader((x, y), 16), make_loader((x, y), 64, shuffle=False))
    assert recorder.threads_inside == 1 and torch.get_num_threads() == threads
    assert recorder.events == ["fit_start", "epoch_start 0", "log 2", "log 4", "validation_end", "checkpoint last.pt",
                               "checkpoint best.pt", "epoch_end 0", "fit_end"]


def test_callback_with_a_misspelt_event_is_rejected() -> None:
    class Typo:
        def on_epoch_ends(self, trainer: Trainer, epoch: int) -> None: ...

    with pytest.raises(TypeError, match="unknown methods on_epoch_ends; valid events: on_fit_start"):
        Trainer(nn.Linear(2, 2), config=config(), callbacks=[Typo()])


def test_batch_loss_and_batch_layout_errors() -> None:
    x, y = blobs(n=64)
    triples = [(x[i:i + 16], y[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]
    trainer = Trainer(nn.Linear(8, 4), config=config(epochs=1))
    with pytest.raises(TypeError, match=r"a batch must be \(inputs, targets\); got tuple of length 3.*batch_loss"):
        trainer.fit(triples)
    model = nn.Linear(8, 4)
    trainer = Trainer(model, config=config(epochs=1), batch_loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    assert trainer.fit(triples).steps == 4


def test_loader_without_len_needs_limit_batches() -> None:
    x, y = blobs(n=64)

    def stream() -> Any:
        for i in range(0, 64, 16):
            yield x[i:i + 16], y[i:i + 16]

    class Stream:
        def __iter__(self) -> Any:
            return stream()

    with pytest.raises(ConfigError, match="no len\\(\\); set limit_batches"):
        Trainer(nn.Linear(8, 4), config=config()).fit(Stream())
    assert Trainer(nn.Linear(8, 4), config=config(epochs=2, limit_batches=3)).fit(Stream()).steps == 6


def test_resume_on_a_plain_dataloader_reads_ahead(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                  stop_at: Callable[[int], object]) -> None:
    x, y = blobs(n=64)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    with pytest.raises(SystemExit):
        Trainer(nn.Linear(8, 4), config=config(epochs=1, log_every=1, checkpoint_dir=str(tmp_path)),
                callbacks=(stop_at(2),)).fit(loader)
    resumed = Trainer(nn.Linear(8, 4), config=config(epochs=1, checkpoint_dir=str(tmp_path)))
    assert resumed.fit(loader, resume=True).steps == 4


def test_resume_errors(tmp_path: Path) -> None:
    x, y = blobs(n=64)
    with pytest.raises(ConfigError, match="resume=True needs checkpoint_dir"):
        Trainer(nn.Linear(8, 4), config=config()).fit(make_loader((x, y), 16), resume=True)
    # nothing to resume from yet: a fresh start (what a requeued job's first attempt needs)
    fresh = Trainer(nn.Linear(8, 4), config=config(epochs=1, checkpoint_dir=str(tmp_path)))
    assert fresh.fit(make_loader((x, y), 16), resume=True).steps == 4
    with pytest.raises(CheckpointError, match="does not fit this model"):
        Trainer(nn.Linear(8, 5), config=config(epochs=2, checkpoint_dir=str(tmp_path))).fit(
            make_loader((x, y), 16), resume=True)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        Trainer(nn.Linear(8, 4), config=config()).fit(make_loader((x, y), 16), resume=tmp_path / "missing.pt")


def test_channels_last_auto() -> None:
    conv = Trainer(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten()), config=config())
    assert conv.channels_last  # conv net on the CPU
    assert not Trainer(nn.Linear(8, 4), config=config()).channels_last
    assert not Trainer(nn.Conv2d(3, 4, 3), config=config(channels_last=False)).channels_last


@pytest.mark.slow
@pytest.mark.torch_compile
def test_compile(tmp_path: Path) -> None:
    x, y = blobs(n=64)
    seed_all(0)
    result = Trainer(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)),
                     config=config(epochs=1, compile=True, checkpoint_dir=str(tmp_path))).fit(make_loader((x, y), 16))
    assert result.steps == 4
    state = load_checkpoint(tmp_path / "last.pt")
    assert not any(k.startswith("_orig_mod") for k in state["model"])  # saved from the uncompiled module


def test_seed_makes_dropout_reproducible_whatever_the_global_rng() -> None:
    x, y = blobs(n=64)
    states = []
    for noise in (1, 2):
        seed_all(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 4))
        torch.manual_seed(noise)  # the global RNG differs between the two runs when fit starts
        Trainer(model, config=config(epochs=1, seed=7)).fit(make_loader((x, y), 16))
        states.append(model.state_dict())
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key


def test_monitor_summary_in_the_result() -> None:
    x, y = blobs(n=64)
    result = Trainer(nn.Linear(8, 4), config=config(epochs=1, monitor=True)).fit(make_loader((x, y), 16))
    assert result.monitor is not None and "cpu.percent" in result.monitor
    assert result.to_json()["monitor"]["proc.rss_bytes"]["mean"] > 0


def test_preflight_warnings_are_logged_before_the_first_batch(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    from trainfast.envcheck import Check
    from trainfast.trainer import feeding

    monkeypatch.setattr(feeding, "preflight", lambda loader: [Check("shm", "fail", "64 MiB free", "--shm-size=8g")])
    logger = __import__("logging").getLogger("trainfast")
    logger.addHandler(caplog.handler)
    try:
        x, y = blobs(n=64)
        Trainer(nn.Linear(8, 4), config=config(epochs=1)).fit(make_loader((x, y), 16))
    finally:
        logger.removeHandler(caplog.handler)
    assert "pre-flight shm: 64 MiB free (fix: --shm-size=8g)" in caplog.text


def test_cpu_threads_auto_follows_a_tuned_plan() -> None:
    from dataclasses import replace

    from trainfast.trainer.feeding import cpu_threads_beside

    x, y = blobs(n=64)
    loader = make_loader((x, y), 16)
    loader.plan = replace(loader.plan, cpu_threads=1)  # as make_loader(workers="tuned") sets it
    assert cpu_threads_beside(loader, "auto", torch.device("cpu")) == 1


class SignalAt:
    def __init__(self, step: int, signum: signal.Signals) -> None:
        self.step, self.signum = step, signum

    def on_log(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if metrics["step"] == self.step:
            os.kill(os.getpid(), self.signum)


def test_sigusr1_can_be_a_stop_signal_for_slurm_requeue(tmp_path: Path) -> None:
    x, y = blobs(n=64)
    cfg = config(epochs=1, log_every=1, stop_signals="SIGTERM,SIGUSR1", checkpoint_dir=str(tmp_path))
    with pytest.raises(SystemExit) as stopped:
        Trainer(nn.Linear(8, 4), config=cfg, callbacks=(SignalAt(2, signal.SIGUSR1),)).fit(make_loader((x, y), 16))
    assert stopped.value.code == 143 and load_checkpoint(tmp_path / "last.pt")["step"] == 2
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


@pytest.mark.parametrize("bad", ["SIGKILL", "SIGNOPE", ""])
def test_bad_stop_signals(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"not valid|names no signal"):
        config(stop_signals=bad)


def test_an_unsharded_loader_is_flagged_for_distributed_runs(caplog: pytest.LogCaptureFixture) -> None:
    x, y = blobs(n=64)
    from trainfast.trainer.feeding import check_sharding

    logger = __import__("logging").getLogger("trainfast")
    logger.addHandler(caplog.handler)
    try:
        check_sharding(make_loader((x, y), 16))  # trainfast loaders shard themselves
        assert "not sharded" not in caplog.text
        check_sharding(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16))
    finally:
        logger.removeHandler(caplog.handler)
    assert "not sharded" in caplog.text and "DistributedSampler" in caplog.text
