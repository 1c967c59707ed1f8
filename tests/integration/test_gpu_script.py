"""benchmarks/gpu.sh must run first time on a GPU machine: every part it runs is exercised here on the CPU (with
ALLOW_CPU=1), the GPU acceptance tests (tests/gpu) included, which skip here for lack of CUDA. Without CUDA and
without that opt-in it stops at once; missing packages are installed from a local wheel folder (WHEELS); its
time limits leave a cold torch.compile room."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import psutil
import pytest
import torch

from trainfast.data.synthetic import DemoSize, demo_dir, ensure_demo_dataset

REPO = Path(__file__).resolve().parents[2]
GPU_SH = REPO / "benchmarks" / "gpu.sh"
MIN_GPU_TESTS = 12
NO_CUDA = "needs a CUDA device; this machine has none"  # tests/conftest.py's skip reason
# Inductor's first compile of a small model on a GPU, fwd + bwd, nothing cached: 40-90 s.
COLD_COMPILE_S = 90
SMALLER_QUICK = DemoSize(name="quick", train_per_class=48, val_per_class=8)
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: gpu.sh would run")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("size", ["small", pytest.param("full", marks=pytest.mark.stress)])
def test_gpu_script_runs_every_part_on_the_cpu(size: str, demo_cache: Path, tiny_images: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Its bench and demo parts are the real `trainfast bench --quick` and `trainfast demo --quick`, run here as the
    CLI runs them, and their reports are checked in full. make test runs them smaller (bench on the tiny dataset with
    4 steps a row, the demo for 1 of its 3 epochs on a smaller demo dataset: 48 training and 8 validation images per
    class in the place of the quick dataset's 160 and 40, in a cache of the test's own), make stress at gpu.sh's
    size, where both of the demo's runs must also learn (after one epoch of 25 steps both are still at chance on the
    CPU)."""
    out = tmp_path / "out"
    env = os.environ | {"OUT": str(out), "PYTHON": sys.executable, "ALLOW_CPU": "1",  # the CPU smoke test, on purpose
                        "SUITE_ARGS": "--device cpu --tiny", "LIMIT_SCALE": "3", "TRAINFAST_CACHE": str(demo_cache)}
    if size == "small":
        env |= {"BENCH_ARGS": f"--steps 4 --data {tiny_images}", "DEMO_ARGS": "--epochs 1",
                "TRAINFAST_CACHE": str(smaller_quick_dataset(tmp_path / "cache", monkeypatch))}
    rc, stdout, stderr, _ = run_script(env, timeout=580)
    assert rc == 0, stdout[-4000:] + stderr[-2000:]
    assert "== ALLOW_CPU=1: CUDA is not available" in stdout, stdout[:2000]
    suite = json.loads((out / "gpu_suite.json").read_text())
    for name in ("precision", "channels_last", "compile", "h2d_bandwidth"):
        assert "error" not in suite[name], suite[name]
    assert set(suite["precision"]) == {"32-true", "bf16-mixed", "16-mixed"}
    assert suite["h2d_bandwidth"]["pageable"]["gb_per_s"] > 0
    assert "pinned memory needs CUDA" in suite["h2d_bandwidth"]["pinned"]["error"]
    bench = json.loads((out / "bench.json").read_text())
    assert [r["num_workers"] for r in bench["workers"]][:3] == [0, 1, 2]
    assert all(r["samples_per_s"] for r in bench["workers"])
    assert [r["batch_size"] for r in bench["precision"]] == [64, 64, 128, 128, 256, 256]
    batches = 80 // 64 if size == "small" else 25  # a whole epoch of batch 64: the tiny or the quick dataset
    assert bench["naive_vs_trainfast"]["naive"]["steps"] == 3 * batches
    assert bench["settings"]["precision_steps"] == (4 if size == "small" else 12)
    assert (out / "bench.png").stat().st_size > 10_000 and (out / "bench.md").exists()
    demo = json.loads((out / "demo.json").read_text())
    assert [r["name"] for r in demo["runs"]] == ["naive", "trainfast"]
    naive, fast = demo["runs"]
    assert naive["steps"] == fast["steps"] == (SMALLER_QUICK.train_per_class * 10 // 64 if size == "small" else 25)
    for run in demo["runs"]:
        assert {"samples_per_s", "data_wait_fraction", "steps", "final_loss", "val_accuracy"} <= set(run)
        assert 0 <= run["val_accuracy"] <= 1
        if size == "full":
            assert run["val_accuracy"] > 0.25  # 10 classes: chance is 0.10
    assert demo["speedup"] > 0
    assert demo["speedup"] == pytest.approx(fast["samples_per_s"] / naive["samples_per_s"])
    assert demo["hardware"]["cpus"] >= 1
    assert "naive vs trainfast" in (out / "demo.log").read_text()
    assert [r["device"] for r in demo["runs"]] == ["cpu", "cpu"] and demo["device"] == "cpu"
    assert json.loads((out / "env.json").read_text())["torch"]
    # the GPU acceptance tests ran as their own part, every one skipped (no CUDA here), and that part passed
    log = (out / "gpu_tests.log").read_text()
    assert "SKIPPED" in log and NO_CUDA in log, log[-3000:]
    assert "deselected" not in log, log[:3000]  # `-m gpu` left no test out: every test in tests/gpu is marked gpu
    assert "== gpu_tests: exit 0" in stdout, stdout[-4000:]
    root = ET.parse(out / "gpu_tests.xml").getroot()
    junit = root if root.tag == "testsuite" else root.find("testsuite")  # pytest writes <testsuites><testsuite>
    assert junit is not None
    tests, skipped = int(junit.get("tests", 0)), int(junit.get("skipped", 0))
    assert tests >= MIN_GPU_TESTS and skipped == tests, (tests, skipped)
    assert int(junit.get("failures", 0)) == int(junit.get("errors", 0)) == 0
    reasons = [skip.get("message", "") for skip in junit.iter("skipped")]
    assert len(reasons) == tests and all(NO_CUDA in r for r in reasons), reasons[:3]


def smaller_quick_dataset(cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache whose "quick" demo dataset is `SMALLER_QUICK`: `trainfast demo --quick` finds it complete and trains on
    it (the same code on fewer images)."""
    monkeypatch.setenv("TRAINFAST_CACHE", str(cache))
    ensure_demo_dataset(SMALLER_QUICK, root=demo_dir("quick"), processes=1)
    return cache


def run_script(env: dict[str, str], timeout: float) -> tuple[int | None, str, str, float]:
    """gpu.sh's exit code (None: still running after `timeout`, then stopped with all it started), stdout, stderr
    and seconds taken."""
    started = time.monotonic()
    with subprocess.Popen(["bash", str(GPU_SH)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # every process it started, by id: `timeout` puts each part in a process group of its own
            for child in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            out, err = proc.communicate()
            return None, out, err, time.monotonic() - started
    return proc.returncode, out, err, time.monotonic() - started


def script_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ALLOW_CPU", "WHEELS")}
    return env | {"OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "TRAINFAST_CACHE": str(tmp_path / "cache"),
                  **extra}


@needs_no_cuda
@pytest.mark.timeout(90)
def test_without_cuda_it_stops_at_once_saying_so(tmp_path: Path) -> None:
    rc, out, err, seconds = run_script(script_env(tmp_path), timeout=60)
    assert rc == 2, f"exit {rc} after {seconds:.0f} s\n{out[-3000:]}\n{err[-2000:]}"
    assert seconds < 30, seconds
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"gpu.sh: CUDA is not available to {sys.executable} (torch {torch.__version__}")
    assert "ALLOW_CPU=1" in lines[0]  # and how to run the CPU smoke test instead
    assert not (tmp_path / "out").exists()  # no part started


def hide_rich(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment where the `rich` package is missing until a fake `pip install` runs; the pip log's path.

    PYTHON is a wrapper that records `-m pip ...` instead of running it (and marks rich installed), and runs
    this Python for everything else, with a sitecustomize that hides rich until then."""
    hider, installed, pip_log = tmp_path / "hider", tmp_path / "installed", tmp_path / "pip.log"
    hider.mkdir()
    (hider / "sitecustomize.py").write_text(
        "import os, sys\n"
        "class _Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] == 'rich' and not os.path.exists({str(installed)!r}):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, _Hide())\n")
    python = tmp_path / "python"
    python.write_text("#!/usr/bin/env bash\n"
                      f'if [ "$1" = -m ] && [ "$2" = pip ]; then shift 2; echo "$*" >> {str(pip_log)!r}; '
                      f"touch {str(installed)!r}; exit 0; fi\n"
                      f'exec {sys.executable!r} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    path = os.environ.get("PYTHONPATH")
    env = script_env(tmp_path, PYTHON=str(python), PYTHONPATH=str(hider) + (os.pathsep + path if path else ""))
    return env, pip_log


@pytest.mark.timeout(90)
def test_a_missing_package_stops_it_naming_the_package_and_the_wheel_folder_option(tmp_path: Path) -> None:
    env, pip_log = hide_rich(tmp_path)
    rc, out, err, seconds = run_script(env, timeout=60)
    assert rc == 2 and seconds < 30, f"exit {rc} after {seconds:.0f} s\n{out[-3000:]}\n{err[-2000:]}"
    lines = err.splitlines()
    assert len(lines) == 1 and "missing" in lines[0] and " rich" in lines[0] and "WHEELS=" in lines[0], err
    assert not pip_log.exists()


@needs_no_cuda
@pytest.mark.timeout(90)
def test_missing_packages_are_installed_from_the_local_wheel_folder(tmp_path: Path) -> None:
    env, pip_log = hide_rich(tmp_path)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    rc, out, err, seconds = run_script(env | {"WHEELS": str(wheels)}, timeout=60)
    # installed offline, only what was missing; then on to the CUDA check, which stops it here
    assert pip_log.read_text().split() == ["install", "--no-index", "--find-links", str(wheels), "rich"]
    assert rc == 2, f"exit {rc} after {seconds:.0f} s\n{out[-3000:]}\n{err[-2000:]}"
    assert err.splitlines()[-1].startswith("gpu.sh: CUDA is not available"), err


def test_a_wheel_folder_that_is_not_a_folder_is_refused(tmp_path: Path) -> None:
    env, pip_log = hide_rich(tmp_path)
    rc, out, err, _ = run_script(env | {"WHEELS": str(tmp_path / "nowhere")}, timeout=60)
    assert rc == 2 and not pip_log.exists(), out + err
    assert err.splitlines() == [f"gpu.sh: WHEELS={tmp_path / 'nowhere'} is not a folder; give the folder that holds "
                                "the wheels (pip download -d DIR PACKAGES on a machine with internet)"]


def limits() -> dict[str, int]:
    """Each part's time limit in gpu.sh, seconds before LIMIT_SCALE; "per_test": pytest's limit per GPU test."""
    text = GPU_SH.read_text()
    parts = {name: int(seconds) for name, seconds in re.findall(r"\bpart (\w+) (\d+) ", text)}
    per_test = re.search(r"-o timeout=\$\(\( (\d+) \*", text)
    assert per_test is not None, "gpu_tests: no per-test time limit found"
    env_json = re.search(r"timeout \$\(\( (\d+) \* \$\{LIMIT_SCALE:-1\} \)\) \"\$PY\" -m trainfast env", text)
    assert env_json is not None
    return parts | {"env_json": int(env_json.group(1)), "per_test": int(per_test.group(1))}


def test_time_limits_fit_a_cold_compile_and_add_up_to_the_header() -> None:
    t = limits()
    assert set(t) == {"env", "env_json", "gpu_tests", "gpu_suite", "bench", "demo", "per_test"}, t
    # tests/gpu compiles once (compile="auto"): a cold compile and its A/B steps in one test, the others beside it
    assert t["per_test"] >= COLD_COMPILE_S + 30, t
    assert t["gpu_tests"] >= t["per_test"] + 60, t
    # gpu_suite.py: a cold compile of its ConvNet, and the precision and channels_last A/Bs before it
    assert t["gpu_suite"] >= COLD_COMPILE_S + 60, t
    total = sum(v for k, v in t.items() if k != "per_test")
    promised = re.search(r"they add up to (\d+) s", GPU_SH.read_text())
    assert promised is not None and int(promised.group(1)) == total, (total, promised)
    assert total <= 600, total  # one 10-minute command on a lent GPU machine
