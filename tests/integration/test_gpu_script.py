"""benchmarks/gpu.sh must run first time on a GPU machine: every part it runs is exercised here on the CPU, the
GPU acceptance tests (tests/gpu) included, which skip here for lack of CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MIN_GPU_TESTS = 12
NO_CUDA = "needs a CUDA device; this machine has none"  # tests/conftest.py's skip reason


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
    # the GPU acceptance tests ran as their own part, every one skipped (no CUDA here), and that part passed
    log = (out / "gpu_tests.log").read_text()
    assert "SKIPPED" in log and NO_CUDA in log, log[-3000:]
    assert "== gpu_tests: exit 0" in done.stdout, done.stdout[-4000:]
    root = ET.parse(out / "gpu_tests.xml").getroot()
    junit = root if root.tag == "testsuite" else root.find("testsuite")  # pytest writes <testsuites><testsuite>
    assert junit is not None
    tests, skipped = int(junit.get("tests", 0)), int(junit.get("skipped", 0))
    assert tests >= MIN_GPU_TESTS and skipped == tests, (tests, skipped)
    assert int(junit.get("failures", 0)) == int(junit.get("errors", 0)) == 0
    reasons = [skip.get("message", "") for skip in junit.iter("skipped")]
    assert len(reasons) == tests and all(NO_CUDA in r for r in reasons), reasons[:3]


def collect(*args: str) -> tuple[list[str], subprocess.CompletedProcess[str]]:
    """Test ids pytest collects from tests/gpu with `args`."""
    path = os.environ.get("PYTHONPATH")
    env = os.environ | {"PYTHONPATH": str(REPO / "src") + (os.pathsep + path if path else "")}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args,
                           "tests/gpu"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    return [line for line in done.stdout.splitlines() if "::" in line], done


@pytest.mark.timeout(240)
def test_gpu_acceptance_suite_collects_at_least_12_gpu_tests() -> None:
    """`pytest -m gpu` finds the GPU suite on any machine, and every test in it carries the marker."""
    gpu, done = collect("-m", "gpu")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(gpu) >= MIN_GPU_TESTS, gpu
    unmarked, done = collect("-m", "not gpu")
    assert unmarked == [] and done.returncode == 5, done.stdout[-3000:]  # 5: every test deselected
