"""`trainfast bench`'s tables: the rich rendering and the markdown file say the same, with OOM rows and notes."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from trainfast.bench.tables import precision_cells, render, to_markdown, versus_line, workers_cells

HARDWARE = {"cpu": "Test CPU", "cpus": 2, "cgroup_cpu_limit": None, "memory_bytes": 24 * 2**30, "gpus": [],
            "torch": "2.13.0+cpu", "python": "3.11.7", "platform": "Linux-test"}


def report(*, device: str = "cpu", oom: bool = True) -> dict[str, Any]:
    source = "gpu" if device.startswith("cuda") else "cpu"
    workers = [{"num_workers": n, "epoch_s": 4.0 / (n + 1), "samples_per_s": 400.0 * (n + 1),
                "data_wait_fraction": 0.6 / (n + 1), "util": 50.0 + 10 * n, "util_source": source,
                "cpu_threads": max(1, 2 - n), "batches_measured": 20, "batches_per_epoch": 25,
                "epoch_extrapolated": True, "error": None, "oom": False} for n in range(3)]
    mem = "cuda" if device.startswith("cuda") else "rss"
    precision = []
    for batch in (64, 128, 256):
        for name, rate in (("32-true", 1000.0), ("bf16-mixed", 1800.0)):
            failed = oom and batch == 256 and name == "32-true"
            precision.append({"precision": name, "batch_size": batch, "steps": 12, "mem_source": mem,
                              "peak_mem_bytes": None if failed else batch * 2**20, "oom": failed,
                              "samples_per_s": None if failed else rate,
                              "speed_vs_fp32": None if failed or batch == 256 else rate / 1000.0})
    versus = {"naive": {"samples_per_s": 414.0, "data_wait_fraction": 0.6},
              "trainfast": {"samples_per_s": 785.0, "data_wait_fraction": 0.06}, "speedup": 785 / 414,
              "spec": {"epochs": 3, "batches_per_epoch": 25}}
    return {"workers": workers, "precision": precision, "naive_vs_trainfast": versus, "hardware": HARDWARE,
            "device": device, "command": "trainfast bench --quick", "wall_s": 65.0,
            "settings": {"batch_size": 64, "image_size": 64, "warmup_steps_excluded": 3,
                         "workers_precision": "32-true"}}


def test_workers_cells() -> None:
    cells = workers_cells(report())
    assert cells.headers == ["num_workers", "threads", "epoch time", "samples/s", "data wait", "CPU util"]
    assert cells.rows[0] == ["0", "2", "4.00 s", "400", "60%", "50%"]
    assert cells.best == 2  # the fastest row
    assert any("extrapolated from 20 measured batches" in n and "25 batches" in n for n in cells.notes)
    assert any("threads" in n for n in cells.notes)
    assert workers_cells(report(device="cuda:0")).headers[-1] == "GPU util"


def test_precision_cells_mark_oom_and_the_speed_vs_fp32() -> None:
    cells = precision_cells(report())
    assert cells.headers == ["precision", "batch", "peak memory (RSS growth)", "samples/s",
                             "speed vs fp32 at same batch"]
    assert cells.rows[1] == ["bf16-mixed", "64", "64.0 MiB", "1,800", "1.80x"]
    assert cells.rows[4] == ["32-true", "256", "OOM", "–", "–"]
    assert any("OOM" in n for n in cells.notes)
    assert precision_cells(report(device="cuda:0")).headers[2] == "peak memory (CUDA allocated)"


def test_versus_line_and_skips() -> None:
    assert "1.90x samples/s" in versus_line(report()) and "414" in versus_line(report())
    skipped = report() | {"naive_vs_trainfast": {"skipped": "no val folder"}}
    assert versus_line(skipped) == "naive vs trainfast: skipped (no val folder)"


def test_markdown_has_both_tables_the_machine_and_the_command() -> None:
    text = to_markdown(report())
    assert "`trainfast bench --quick`" in text
    assert "Test CPU, 2 CPUs, 24.0 GiB, no GPU, torch 2.13.0+cpu" in text
    assert "| num_workers | threads | epoch time | samples/s | data wait | CPU util |" in text
    assert "| --- | --- | --- | --- | --- | --- |" in text
    assert "| **2** | **1** | **1.33 s** | **1,200** | **20%** | **70%** |" in text
    assert "| 32-true | 256 | OOM | – | – |" in text
    assert "### Naive vs trainfast" in text and "1.90x" in text
    assert text.count("\n| ") >= 2 + 3 + 2 + 6


def test_rich_render_prints_both_tables() -> None:
    out = io.StringIO()
    render(report(), Console(file=out, width=140, color_system=None))
    text = out.getvalue()
    for expected in ("Loader workers", "Precision x batch size", "num_workers", "CPU util", "OOM",
                     "speed vs fp32 at same batch", "naive vs trainfast", "Test CPU"):
        assert expected in text
