"""`trainfast bench --plot`: a valid, non-blank PNG, no pyplot state left behind, a clear error without matplotlib."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from trainfast.bench.plot import INSTALL_HINT, PlotUnavailableError, plot_report, require_matplotlib

HARDWARE = {"cpu": "Test CPU", "cpus": 2, "cgroup_cpu_limit": None, "memory_bytes": 24 * 2**30, "gpus": [],
            "torch": "2.13.0+cpu", "python": "3.11.7", "platform": "Linux-test"}


def report(versus: dict[str, Any] | None = None) -> dict[str, Any]:
    workers = [{"num_workers": n, "epoch_s": 4.0 / (n + 1), "samples_per_s": 400.0 * (n + 1),
                "data_wait_fraction": 0.6 / (n + 1), "util": 50.0 + 10 * n, "util_source": "cpu",
                "cpu_threads": max(1, 2 - n)} for n in range(3)]
    precision = [{"precision": name, "batch_size": b, "mem_source": "rss", "oom": b == 256 and name == "32-true",
                  "peak_mem_bytes": None if b == 256 and name == "32-true" else b * 2**20,
                  "samples_per_s": None if b == 256 and name == "32-true" else rate, "speed_vs_fp32": rate / 1000}
                 for b in (64, 128, 256) for name, rate in (("32-true", 1000.0), ("bf16-mixed", 1800.0))]
    versus = versus if versus is not None else {
        "naive": {"samples_per_s": 414.0, "data_wait_fraction": 0.6},
        "trainfast": {"samples_per_s": 785.0, "data_wait_fraction": 0.06}, "speedup": 785 / 414,
        "spec": {"epochs": 3, "batches_per_epoch": 25}}
    return {"workers": workers, "precision": precision, "naive_vs_trainfast": versus, "hardware": HARDWARE,
            "device": "cpu", "command": "trainfast bench --quick", "settings": {"batch_size": 64, "image_size": 64}}


@pytest.mark.parametrize("versus", [None, {"skipped": "no val folder"}])
@pytest.mark.slow
def test_png_is_written_valid_and_not_blank(tmp_path: Path, versus: dict[str, Any] | None) -> None:
    pyplot_loaded = "matplotlib.pyplot" in sys.modules
    path = plot_report(report(versus), tmp_path / "out" / "bench.png")
    assert path == tmp_path / "out" / "bench.png"
    with Image.open(path) as image:
        assert image.format == "PNG"
        image.verify()
    with Image.open(path) as image:
        assert image.width >= 1000 and image.height >= 700
        colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 50  # bars, lines, text: far more than a blank canvas
    assert max(count for count, _ in colors) < 0.9 * image.width * image.height  # not all one colour
    assert ("matplotlib.pyplot" in sys.modules) == pyplot_loaded  # drawn without pyplot's global state
    assert not list(tmp_path.glob("out/.trainfast-*"))  # the atomic write left no temp file


def test_without_matplotlib_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(PlotUnavailableError, match=r"pip install trainfast\[plot\]"):
        require_matplotlib()
    with pytest.raises(ImportError, match=r"pip install trainfast\[plot\]"):
        plot_report(report(), tmp_path / "bench.png")
    assert not (tmp_path / "bench.png").exists()
    assert INSTALL_HINT == "pip install trainfast[plot]"
