"""Both sides of naive vs trainfast run on the same device, the one the trainfast side resolves ("auto": CUDA when
there is one), in `trainfast demo` and in `trainfast bench`; the JSON and the tables record each run's device.

CUDA is faked: device resolution returns a CUDA device, and everything that would touch it (the naive loop, the
Trainer, the loaders) is replaced by recorders, so these tests only check which device each side is handed."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from rich.console import Console

from trainfast.bench import demo, sweeps
from trainfast.bench.demo import QUICK, render_table, run_demo
from trainfast.bench.naive import RunStats
from trainfast.bench.sweeps import BenchSpec, run_bench
from trainfast.bench.tables import versus_line

FAKE_CUDA = torch.device("cuda", 3)
AB_STEPS = {"precision": 6, "channels_last": 10, "compile": 0}  # what the faked Trainer's A/Bs took, of its 40 steps
SPEC = replace(QUICK, epochs=1, batch_size=16, image_size=16)


def stats(name: str, device: str) -> RunStats:
    return RunStats(name=name, samples_per_s=100.0 if name == "naive" else 250.0, data_wait_fraction=0.5, steps=5,
                    final_loss=1.0, val_accuracy=0.5, wall_s=1.0, device=device)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch, tiny_images: Path) -> dict[str, list[Any]]:
    """"auto" resolves to FAKE_CUDA; records the device the naive loop, the Trainer and every loader are given."""
    seen: dict[str, list[Any]] = {"naive": [], "trainer": [], "loaders": []}
    monkeypatch.setattr(demo, "resolve_device", lambda spec: FAKE_CUDA, raising=False)
    monkeypatch.setattr(sweeps, "resolve_device", lambda spec: FAKE_CUDA)
    monkeypatch.setattr(demo, "ensure_demo_dataset", lambda *args, **kwargs: tiny_images)

    def naive_fit(*args: Any, device: torch.device, **kwargs: Any) -> RunStats:
        seen["naive"].append(device)
        return stats("naive", str(device))

    class Trainer:
        def __init__(self, model: Any, config: Any) -> None:
            seen["trainer"].append(config.device)

        def fit(self, *args: Any) -> Any:
            return SimpleNamespace(samples_per_s=250.0, data_wait_fraction=0.1, steps=40, final_loss=1.0,
                                   val_accuracy=0.6, wall_s=1.0, ab_steps=AB_STEPS)

    def make_loader(*args: Any, **kwargs: Any) -> object:
        seen["loaders"].append(kwargs.get("device", "auto"))
        return object()

    monkeypatch.setattr(demo, "naive_fit", naive_fit)
    monkeypatch.setattr(demo, "Trainer", Trainer)
    monkeypatch.setattr(demo, "make_loader", make_loader)
    return seen


def test_demo_runs_the_naive_side_on_the_trainfast_sides_device(fake_cuda: dict[str, list[Any]]) -> None:
    out = io.StringIO()
    report = run_demo(SPEC, console=Console(file=out, width=160, color_system=None))
    assert fake_cuda["naive"] == [FAKE_CUDA]
    assert fake_cuda["trainer"] == ["cuda:3"] and fake_cuda["loaders"] == [FAKE_CUDA, FAKE_CUDA]
    assert [(r["name"], r["device"]) for r in report["runs"]] == [("naive", "cuda:3"), ("trainfast", "cuda:3")]
    assert report["device"] == "cuda:3"
    for key in ("samples_per_s", "data_wait_fraction", "steps", "final_loss", "val_accuracy"):  # DESIGN.md §3
        assert all(key in r for r in report["runs"])
    assert report["speedup"] == pytest.approx(2.5)
    assert "cuda:3" in out.getvalue()  # the table's device column
    assert report["ab_steps"] == report["runs"][1]["ab_steps"] == AB_STEPS and "ab_steps" not in report["runs"][0]
    assert report["ab_share"] == pytest.approx(16 / 40)
    assert "A/Bs: precision 6 + channels_last 10 = 16 of 40 steps (40%)" in out.getvalue()  # (the A/Bs that ran)


def test_bench_runs_both_sides_on_the_bench_device(fake_cuda: dict[str, list[Any]], tiny_images: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # the workers and precision rows take the bench device already (test_bench_sweeps); only naive vs trainfast here
    monkeypatch.setattr(sweeps, "measure_workers", lambda *args, **kwargs: [])
    monkeypatch.setattr(sweeps, "measure_precision", lambda *args, **kwargs: [])
    monkeypatch.setattr(sweeps, "workers_precision", lambda device: "bf16-mixed")  # device_caps would ask CUDA
    spec = BenchSpec(demo=SPEC, batch_size=16, image_size=16, worker_batches=2, precision_steps=2, workers=(0,))
    report = run_bench(spec, tiny_images)
    assert fake_cuda["naive"] == [FAKE_CUDA] and fake_cuda["trainer"] == ["cuda:3"]
    assert fake_cuda["loaders"] == [FAKE_CUDA, FAKE_CUDA]
    versus = report["naive_vs_trainfast"]
    assert versus["naive"]["device"] == versus["trainfast"]["device"] == report["device"] == "cuda:3"
    assert "both on cuda:3" in versus_line(report)


def test_the_tables_say_each_runs_device() -> None:
    versus = {"naive": {"samples_per_s": 400.0, "data_wait_fraction": 0.6, "device": "cpu"},
              "trainfast": {"samples_per_s": 800.0, "data_wait_fraction": 0.1, "device": "cuda:0"}, "speedup": 2.0}
    assert "naive on cpu, trainfast on cuda:0" in versus_line({"naive_vs_trainfast": versus})
    for run in versus.values():  # reports written before runs recorded their device say nothing about it
        if isinstance(run, dict):
            del run["device"]
    assert " on " not in versus_line({"naive_vs_trainfast": versus})
    report = {"runs": [stats("naive", "cuda:0").to_json(), stats("trainfast", "cuda:0").to_json()], "speedup": 2.5,
              "repeats": 1, "hardware": {"cpu": "Test CPU", "cpus": 2, "memory_bytes": 2**34, "gpus": ["H200"],
                                         "torch": "2.13.0"}}
    out = io.StringIO()
    Console(file=out, width=160, color_system=None).print(render_table(report))
    assert out.getvalue().count("cuda:0") == 2
