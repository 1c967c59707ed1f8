"""benchmarks/gpu.sh must run first time on a GPU machine: every part it runs is exercised here on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpu_script_runs_every_part_on_the_cpu(tiny_images: Path, demo_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = os.environ | {"OUT": str(out), "PYTHON": sys.executable, "SUITE_ARGS": "--device cpu --tiny",
                        "LIMIT_SCALE": "3", "BENCH_ARGS": f"--data {tiny_images}", "TRAINFAST_CACHE": str(demo_cache)}
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu.sh")], env=env, capture_output=True, text=True,
                          timeout=580)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    suite = json.loads((out / "gpu_suite.json").read_text())
    for name in ("precision", "channels_last", "compile", "h2d_bandwidth"):
        assert "error" not in suite[name], suite[name]
    assert set(suite["precision"]) == {"32-true", "bf16-mixed", "16-mixed"}
    assert suite["h2d_bandwidth"]["pageable"]["gb_per_s"] > 0
    assert "pinned memory needs CUDA" in suite["h2d_bandwidth"]["pinned"]["error"]
    bench = json.loads((out / "bench.json").read_text())
    assert bench["workers"] and bench["precision"]
    assert (out / "bench.png").stat().st_size > 10_000 and (out / "bench.md").exists()
    demo = json.loads((out / "demo.json").read_text())
    assert demo["speedup"] > 0
    assert json.loads((out / "env.json").read_text())["torch"]
