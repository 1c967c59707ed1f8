"""tuned.py: the cache of tuned loader settings that `trainfast tune` writes and `workers="tuned"` reads: its key,
the save/load round trip, files it must skip, and the files earlier versions wrote."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from trainfast.loader import Loader, make_loader, tuned
from trainfast.loader.tuned import WorkerSettings
from trainfast.tune import result as tune_result
from trainfast.tune.trial import Trial

HARDWARE = "cpus=2;gpus=cpu;torch=2.0"
# A record as `trainfast tune` wrote it before the cache moved to the loader (byte for byte what to_json gave).
EARLIER_RECORD = {
    "chosen": {"num_workers": 2, "prefetch_factor": 2, "pin_memory": False, "cpu_threads": 1},
    "chosen_samples_per_s": 300.0,
    "baseline": {"num_workers": 0, "prefetch_factor": None, "pin_memory": False, "cpu_threads": None},
    "baseline_samples_per_s": 100.0, "speedup": 3.0,
    "trials": [{"config": {"num_workers": 0, "prefetch_factor": None, "pin_memory": False, "cpu_threads": None},
                "samples_per_s": 100.0, "seconds": 1.5},
               {"config": {"num_workers": 2, "prefetch_factor": 2, "pin_memory": False, "cpu_threads": 1},
                "samples_per_s": 300.0, "seconds": 2.0}],
    "sweep_seconds": 12.5, "key": "k", "describes": {"batch_size": 4}, "format": 1}


def tensors(n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(n, 3), torch.zeros(n, dtype=torch.long)


@pytest.fixture
def fixed_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuned, "hardware_signature", lambda: HARDWARE)


def write(dataset: Any, batch_size: int, record: Any, *, with_step: bool = True, text: str | None = None) -> Path:
    key, _ = tuned.cache_key(dataset, batch_size, with_step=with_step, device="cpu")
    path = tuned.cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record) if text is None else text)
    return path


@pytest.fixture
def warnings(caplog: pytest.LogCaptureFixture) -> Any:
    logger = logging.getLogger("trainfast")  # may not propagate to the root logger: listen on it directly
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


def test_the_key_is_stable_and_a_record_from_before_the_confirmation_is_not_used(
        cache_dir: Path, fixed_hardware: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The digest depends only on what it describes (files on disk keep being found), and on the format: a
    format-1 choice was never confirmed against "auto" (one trained at half auto's speed), so it is not read."""
    step_key, describes = tuned.cache_key(tensors(), 4, with_step=True, device="cpu")
    assert step_key == "b22520a878a5b9645c31"
    assert describes == {"dataset": "tensors:(10, 3):torch.float32;(10,):torch.int64", "batch_size": 4,
                         "with_step": True, "device": "cpu", "hardware": HARDWARE, "format": 2}
    assert tuned.cache_key(tensors(), 4, with_step=False, device="cpu")[0] == "412b71858b8ad92eef90"
    with monkeypatch.context() as m:
        m.setattr(tuned, "FORMAT", 1)
        assert write(tensors(), 4, EARLIER_RECORD) == cache_dir / "tune" / "1e1b75adb4a8f8930153.json"
    assert tuned.load(tensors(), 4, device="cpu") is None
    assert tune_result.load(tensors(), 4, device="cpu") is None


def test_a_record_without_the_later_fields_still_loads(cache_dir: Path, fixed_hardware: None) -> None:
    write(tensors(), 4, EARLIER_RECORD)
    assert tuned.load(tensors(), 4, device="cpu") == WorkerSettings(2, 2, False, 1)
    loaded = tune_result.load(tensors(), 4, device="cpu")
    assert loaded is not None
    # what later versions added reads as its old meaning: worker processes, an unknown batch count, no confirmation
    upgraded = json.loads(json.dumps(EARLIER_RECORD))
    for config in (upgraded["chosen"], upgraded["baseline"], *(t["config"] for t in upgraded["trials"])):
        config["backend"] = "processes"
    for t in upgraded["trials"]:
        t["batches"] = 0
    upgraded |= {"search_seconds": None, "auto": None, "confirmation": None,
                 "kept_reason": "not confirmed against auto", "format": 2}
    assert loaded.to_json() == upgraded


def test_save_then_load_round_trip(cache_dir: Path) -> None:
    chosen, baseline = WorkerSettings(3, 4, True, 2), WorkerSettings(0)
    key, describes = tuned.cache_key(tensors(), 4, with_step=False, device="cpu")
    trials = [Trial(baseline, 50.0, 1.0), Trial(chosen, 250.0, 2.0)]
    result = tune_result.TuneResult(chosen, 250.0, baseline, 50.0, trials, 9.0, key, describes)
    path = tune_result.save(result)
    assert path == tuned.cache_path(key) and json.loads(path.read_text()) == result.to_json()
    assert tuned.load(tensors(), 4, device="cpu") == chosen
    assert tune_result.load(tensors(), 4, device="cpu") == result
    # the loader's own writer: any record with a `chosen` configuration
    tuned.save(key, {"chosen": WorkerSettings(1).to_json()})
    assert tuned.load(tensors(), 4, device="cpu") == WorkerSettings(1)


def test_nothing_cached_is_none(cache_dir: Path) -> None:
    assert tuned.load(tensors(), 4, device="cpu") is None
    assert tune_result.load(tensors(), 4, device="cpu") is None


def test_the_step_record_comes_first_then_the_loader_alone(cache_dir: Path) -> None:
    write(tensors(), 4, {"chosen": WorkerSettings(1).to_json()}, with_step=False)
    assert tuned.load(tensors(), 4, device="cpu") == WorkerSettings(1)
    write(tensors(), 4, {"chosen": WorkerSettings(2, 2).to_json()}, with_step=True)
    assert tuned.load(tensors(), 4, device="cpu") == WorkerSettings(2, 2)


@pytest.mark.parametrize("text", [
    "{not json",
    "",
    "[]",
    "null",
    json.dumps({"speedup": 2.0}),  # no chosen
    json.dumps({"chosen": {"num_workers": 2}}),  # fields missing
    json.dumps({"chosen": "workers=2"}),
    json.dumps({"chosen": {"num_workers": "2", "prefetch_factor": 2, "pin_memory": False, "cpu_threads": None}}),
    json.dumps({"chosen": {"num_workers": -1, "prefetch_factor": None, "pin_memory": False, "cpu_threads": None}}),
    json.dumps({"chosen": {"num_workers": 2, "prefetch_factor": 0, "pin_memory": False, "cpu_threads": None}}),
    json.dumps({"chosen": {"num_workers": 2, "prefetch_factor": 2, "pin_memory": "yes", "cpu_threads": None}}),
    json.dumps({"chosen": {"num_workers": 2, "prefetch_factor": 2, "pin_memory": False, "cpu_threads": 0}}),
    json.dumps({"chosen": {"num_workers": True, "prefetch_factor": 2, "pin_memory": False, "cpu_threads": None}}),
])
def test_a_damaged_record_is_skipped_with_a_warning(cache_dir: Path, warnings: pytest.LogCaptureFixture,
                                                    text: str) -> None:
    path = write(tensors(), 4, None, text=text)
    assert tuned.load(tensors(), 4, device="cpu") is None
    assert f"ignoring unreadable tuning result {path}" in warnings.text
    write(tensors(), 4, {"chosen": WorkerSettings(1).to_json()}, with_step=False)
    assert tuned.load(tensors(), 4, device="cpu") == WorkerSettings(1)  # the loader-alone record behind it


def test_every_part_of_the_key_tells_records_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    def key(dataset: Any = None, batch_size: int = 4, with_step: bool = True, device: str = "cpu") -> str:
        return tuned.cache_key(tensors() if dataset is None else dataset, batch_size, with_step=with_step,
                               device=device)[0]

    keys = [key(), key(tensors(11)), key((torch.zeros(10, 3, dtype=torch.float16), torch.zeros(10))),
            key(TensorDataset(*tensors())), key(batch_size=8), key(with_step=False), key(device="cuda")]
    monkeypatch.setattr(tuned, "available_cpus", lambda: 999)
    keys.append(key())  # other hardware
    monkeypatch.setattr(tuned, "FORMAT", tuned.FORMAT + 1)
    keys.append(key())  # another meaning of the record
    assert len(set(keys)) == len(keys)


def test_another_batch_size_or_device_finds_nothing(cache_dir: Path) -> None:
    write(tensors(), 4, EARLIER_RECORD)
    assert tuned.load(tensors(), 8, device="cpu") is None
    assert tuned.load(tensors(), 4, device="cuda") is None
    assert tuned.load(tensors(12), 4, device="cpu") is None


def test_make_loader_takes_the_tuned_settings(cache_dir: Path) -> None:
    dataset = TensorDataset(*tensors(40))
    write(dataset, 4, EARLIER_RECORD)
    loader = make_loader(dataset, 4, workers="tuned", device="cpu")
    try:
        assert isinstance(loader, Loader)
        assert (loader.plan.num_workers, loader.plan.prefetch_factor, loader.plan.pin_memory,
                loader.plan.cpu_threads) == (2, 2, False, 1)
        assert loader.plan.reasons[0] == "tuned by measurement (workers=2 prefetch=2 threads=1)"
    finally:
        loader.close()


def test_make_loader_without_tuned_settings_uses_auto(cache_dir: Path, warnings: pytest.LogCaptureFixture) -> None:
    loader = make_loader(tensors(40), 4, workers="tuned", device="cpu")
    assert "no tuning result" in warnings.text
    assert loader.plan is not None and loader.plan.cpu_threads is None
    assert not loader.plan.reasons[0].startswith("tuned")


def test_a_remote_pack_is_fingerprinted_by_its_url() -> None:
    from trainfast.loader.tuned import dataset_fingerprint

    class Remote:
        root = "s3://bucket/packs/train"

        def __len__(self) -> int:
            return 10

    assert ":s3://bucket/packs/train:" in dataset_fingerprint(Remote())
