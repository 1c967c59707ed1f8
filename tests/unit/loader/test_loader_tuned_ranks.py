"""`workers="tuned"` under torchrun: `trainfast tune` measured one process owning the machine, so with
LOCAL_WORLD_SIZE processes on it each takes its share of the tuned workers and intra-op threads, as "auto" does,
and says why."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch.utils.data import TensorDataset

from trainfast.loader import tuned
from trainfast.loader.options import LoaderOptions
from trainfast.loader.resolve import resolve_loader
from trainfast.loader.tuned import WorkerSettings

MACHINE_CPUS = 16


def dataset() -> TensorDataset:
    return TensorDataset(torch.zeros(64, 3), torch.zeros(64, dtype=torch.long))


@pytest.fixture
def tuned_14_workers(cache_dir: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 16-CPU machine whose cached tuning chose 14 workers (prefetch 2) and 8 intra-op threads."""
    monkeypatch.setattr("trainfast.loader.resolve.available_cpus", lambda: MACHINE_CPUS)
    monkeypatch.setattr(tuned, "hardware_signature", lambda: f"cpus={MACHINE_CPUS};gpus=cpu;torch=test")
    key, _ = tuned.cache_key(dataset(), 4, with_step=True, device="cpu")
    tuned.save(key, {"chosen": WorkerSettings(14, 2, False, 8).to_json()})


@pytest.mark.parametrize(("local_world", "workers", "threads"), [
    (None, 14, 8), ("1", 14, 8),  # one process: the tuning as measured
    ("2", 7, 4),  # 8 CPUs each
    ("8", 1, 1),  # 2 CPUs each: not 8 x 14 = 112 workers on 16 cores
    ("32", 1, 1),  # fewer CPUs than processes: still one worker, the tuning found workers pay
])
def test_tuned_workers_and_threads_are_the_ranks_share(tuned_14_workers: None, monkeypatch: pytest.MonkeyPatch,
                                                       trainfast_log: pytest.LogCaptureFixture,
                                                       local_world: str | None, workers: int, threads: int) -> None:
    if local_world is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
    plan = resolve_loader(dataset(), 4, LoaderOptions(workers="tuned", device="cpu")).plan
    assert (plan.num_workers, plan.cpu_threads, plan.prefetch_factor) == (workers, threads, 2)
    assert plan.reasons[0] == "tuned by measurement (workers=14 prefetch=2 threads=8)"
    scaled = [r for r in plan.reasons if "LOCAL_WORLD_SIZE" in r]
    if local_world in (None, "1"):
        assert scaled == [] and "LOCAL_WORLD_SIZE" not in trainfast_log.text
    else:
        share = max(1, MACHINE_CPUS // int(local_world))
        assert scaled == [f"workers='tuned' scaled to this process's share: LOCAL_WORLD_SIZE={local_world} processes "
                          f"share {MACHINE_CPUS} CPUs ({share} each) and the tuning measured one process with all "
                          f"{MACHINE_CPUS}: workers 14 -> {workers}, cpu_threads 8 -> {threads}"]
        assert scaled[0] in trainfast_log.text
        assert any(r.levelno == logging.INFO for r in trainfast_log.records if "LOCAL_WORLD_SIZE" in r.getMessage())


def test_a_tuning_without_workers_or_threads_stays_so(cache_dir: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("trainfast.loader.resolve.available_cpus", lambda: MACHINE_CPUS)
    monkeypatch.setattr(tuned, "hardware_signature", lambda: "fixed")
    key, _ = tuned.cache_key(dataset(), 4, with_step=True, device="cpu")
    path = tuned.save(key, {"chosen": WorkerSettings(0).to_json()})
    assert json.loads(path.read_text())["chosen"]["num_workers"] == 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    plan = resolve_loader(dataset(), 4, LoaderOptions(workers="tuned", device="cpu")).plan
    assert (plan.num_workers, plan.cpu_threads) == (0, None)
    assert not any("LOCAL_WORLD_SIZE" in r for r in plan.reasons)  # nothing scaled, nothing to say


@pytest.mark.parametrize(("settings", "machine", "share", "expected"), [
    (WorkerSettings(14, 2, True, None, "threads"), 16, 16, WorkerSettings(14, 2, True, None, "threads")),
    (WorkerSettings(14, 2, True, None, "threads"), 16, 4, WorkerSettings(3, 2, True, None, "threads")),
    (WorkerSettings(3, 4, False, 1), 4, 2, WorkerSettings(1, 4, False, 1)),
    (WorkerSettings(0, None, False, 2), 2, 1, WorkerSettings(0, None, False, 1)),
])
def test_for_share(settings: WorkerSettings, machine: int, share: int, expected: WorkerSettings) -> None:
    assert tuned.for_share(settings, machine_cpus=machine, share_cpus=share) == expected
