"""`trainfast bench`'s measurements on the tiny dataset with tiny settings: row contents, OOM rows, the JSON report."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from trainfast.bench import peak, sweeps
from trainfast.bench.demo import QUICK
from trainfast.bench.sweeps import (
    BenchSpec,
    is_oom,
    measure_naive_vs_trainfast,
    measure_precision,
    measure_workers,
    mixed_precision,
    run_bench,
    worker_counts,
)
from trainfast.trainer.loop import Trainer

CPU = torch.device("cpu")
WORKER_KEYS = {"num_workers", "epoch_s", "samples_per_s", "data_wait_fraction", "util", "util_source"}
PRECISION_KEYS = {"precision", "batch_size", "peak_mem_bytes", "samples_per_s", "oom", "mem_source"}
TINY_SPEC = BenchSpec(demo=replace(QUICK, epochs=1), batch_size=16, image_size=32, worker_batches=4,
                      precision_steps=4, batch_multipliers=(1, 2), workers=(0, 1))


@pytest.mark.parametrize(("cpus", "expected"), [
    (1, [0, 1, 2]), (2, [0, 1, 2]), (4, [0, 1, 2, 3, 4]), (16, list(range(17))),
    (30, [*range(17), 24, 30]), (64, [*range(17), 24, 32, 48, 64]),
])
def test_worker_counts_cover_0_to_the_usable_cpus(cpus: int, expected: list[int]) -> None:
    assert worker_counts(cpus) == expected


def test_mixed_precision_on_the_cpu_is_bf16() -> None:
    assert mixed_precision(CPU) == "bf16-mixed"


@pytest.mark.parametrize(("error", "oom"), [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
    (ValueError("out of memory"), False),
])
def test_is_oom(error: BaseException, oom: bool) -> None:
    assert is_oom(error) is oom


@pytest.mark.slow
def test_workers_rows_report_rate_wait_util_and_threads(tiny_images: Path) -> None:
    lines: list[str] = []
    rows = measure_workers(tiny_images, workers=[0, 1], batch_size=16, image_size=32, limit_batches=4, device=CPU,
                           progress=lines.append)
    assert [r["num_workers"] for r in rows] == [0, 1]
    for row in rows:
        assert set(row) >= WORKER_KEYS
        assert row["samples_per_s"] > 0 and 0 <= row["data_wait_fraction"] <= 1
        assert row["util_source"] == "cpu" and 0 <= row["util"] <= 100
        # 80 images / 16 = 5 batches per epoch, 4 measured: the epoch time is extrapolated from the rate
        assert row["batches_per_epoch"] == 5 and row["batches_measured"] == 4 and row["epoch_extrapolated"]
        assert row["epoch_s"] == pytest.approx(5 * 16 / row["samples_per_s"])
        assert row["cpu_threads"] >= 1 and not row["oom"] and row["error"] is None
    assert len(lines) == 2 and "num_workers=1" in lines[1] and "samples/s" in lines[1]


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB"),
                                   RuntimeError("CUDA out of memory. Tried to allocate 8.00 GiB")])
@pytest.mark.slow
def test_an_out_of_memory_row_is_recorded_and_the_run_goes_on(monkeypatch: pytest.MonkeyPatch,
                                                              error: RuntimeError) -> None:
    class OomAtLargestBatch(Trainer):
        def fit(self, train_loader: Any, *args: Any, **kwargs: Any) -> Any:
            if train_loader.batch_size == 32 and self.precision.name == "32-true":
                raise error
            return super().fit(train_loader, *args, **kwargs)

    monkeypatch.setattr(sweeps, "Trainer", OomAtLargestBatch)
    lines: list[str] = []
    rows = measure_precision(batch_sizes=[8, 16, 32], steps=4, image_size=32, device=CPU, progress=lines.append)
    assert [(r["precision"], r["batch_size"]) for r in rows] == [
        ("32-true", 8), ("bf16-mixed", 8), ("32-true", 16), ("bf16-mixed", 16), ("32-true", 32), ("bf16-mixed", 32)]
    oom = rows[4]
    assert oom["oom"] is True and set(oom) >= PRECISION_KEYS
    assert oom["peak_mem_bytes"] is None and oom["samples_per_s"] is None and oom["speed_vs_fp32"] is None
    assert "out of memory" in oom["error"] and "out of memory" in lines[4]
    after = rows[5]  # the row after the OOM was measured
    assert after["oom"] is False and after["samples_per_s"] > 0 and after["peak_mem_bytes"] > 0
    assert after["speed_vs_fp32"] is None  # no fp32 figure at that batch to compare with
    for row in rows[:4]:
        assert row["oom"] is False and row["samples_per_s"] > 0 and row["mem_source"] == "rss"
        assert row["peak_mem_bytes"] > 0 and row["mem_method"] in ("vmhwm", "sampled")
    assert rows[1]["speed_vs_fp32"] == pytest.approx(rows[1]["samples_per_s"] / rows[0]["samples_per_s"])


def test_other_errors_are_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken(Trainer):
        def fit(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(sweeps, "Trainer", Broken)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        measure_precision(batch_sizes=[8], steps=4, image_size=32, device=CPU)


def test_peak_memory_falls_back_to_sampling_rss_with_the_monitor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peak, "_reset_peak_rss", lambda: False)  # e.g. no /proc/self/clear_refs
    rows = measure_precision(batch_sizes=[32], precisions=["32-true"], steps=4, image_size=32, device=CPU)
    assert rows[0]["mem_method"] == "sampled" and rows[0]["mem_source"] == "rss"
    assert isinstance(rows[0]["peak_mem_bytes"], int) and rows[0]["peak_mem_bytes"] >= 0


def test_naive_vs_trainfast_is_skipped_with_the_reason(tiny_images: Path, tmp_path: Path) -> None:
    no_val = tmp_path / "no_val"
    shutil.copytree(tiny_images / "train", no_val / "train")
    assert "val" in measure_naive_vs_trainfast(QUICK, no_val)["skipped"]
    many = tmp_path / "many"
    image = next((tiny_images / "train").rglob("*.jpg"))
    for c in range(11):
        for split in ("train", "val"):
            (many / split / f"c{c}").mkdir(parents=True)
            shutil.copy(image, many / split / f"c{c}" / image.name)
    assert "11 classes" in measure_naive_vs_trainfast(QUICK, many)["skipped"]


@pytest.mark.slow
def test_run_bench_writes_the_json_contract(tiny_images: Path) -> None:
    lines: list[str] = []
    report = run_bench(TINY_SPEC, tiny_images, progress=lines.append, command="trainfast bench --data x", device=CPU)
    assert set(report) >= {"workers", "precision", "naive_vs_trainfast", "hardware"}
    assert [r["num_workers"] for r in report["workers"]] == [0, 1]
    assert all(set(r) >= WORKER_KEYS for r in report["workers"])
    assert [(r["precision"], r["batch_size"]) for r in report["precision"]] == [
        ("32-true", 16), ("bf16-mixed", 16), ("32-true", 32), ("bf16-mixed", 32)]
    assert all(set(r) >= PRECISION_KEYS for r in report["precision"])
    versus = report["naive_vs_trainfast"]
    assert set(versus) >= {"naive", "trainfast", "speedup"}
    assert versus["speedup"] == pytest.approx(versus["trainfast"]["samples_per_s"] / versus["naive"]["samples_per_s"])
    assert versus["naive"]["steps"] == versus["trainfast"]["steps"] == 80 // 16
    assert report["data_format"] == "image_folder"  # both runs read the folder's JPEG files
    assert versus["reads"] == {"naive": {"format": "image_folder", "decode": "full", "workers": 0},
                               "trainfast": {"format": "image_folder", "decode": "draft", "workers": "auto"}}
    assert set(report["hardware"]) >= {"cpu", "cpus", "memory_bytes", "gpus", "torch"}
    assert report["command"] == "trainfast bench --data x" and report["settings"]["batch_sizes"] == [16, 32]
    json.dumps(report, allow_nan=False)  # strict JSON: no NaN, nothing unserialisable
    assert len(lines) == 2 + 4 + 3  # a line per row as it is measured
