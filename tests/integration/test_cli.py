"""The CLI through `main(argv)` and as a real process: the JSON contract, exit codes, resume and SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import small_train as small
from trainfast.cli import main

TRAIN_KEYS = {"epochs", "steps", "samples_per_s", "data_wait_fraction", "final_loss", "val_accuracy", "checkpoint"}
CHECKPOINT_KEYS = {"model", "optimizer", "scheduler", "scaler", "epoch", "step", "rng", "config", "versions"}


def test_train_writes_the_json_contract_and_loadable_checkpoints(tiny_images: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    assert main(small(tiny_images, "--epochs", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--json", str(out))) == 0
    result = json.loads(out.read_text())
    assert set(result) >= TRAIN_KEYS
    assert result["epochs"] == 2 and result["steps"] == 2 * (80 // 16)
    assert result["checkpoint"] == str(tmp_path / "ck" / "last.pt")
    for name in ("last.pt", "best.pt"):
        state = torch.load(tmp_path / "ck" / name, weights_only=True)
        assert set(state) >= CHECKPOINT_KEYS
    # --resume continues where the last run ended
    assert main(small(tiny_images, "--epochs", "3", "--checkpoint-dir", str(tmp_path / "ck"), "--resume",
                      "--json", str(out))) == 0
    result = json.loads(out.read_text())
    assert result["epochs"] == 3 and result["steps"] == 3 * (80 // 16)


@pytest.mark.parametrize(("argv", "message"), [
    (["--batch-size", "0"], "argument --batch-size: 0 is not valid; use a positive integer"),
    (["--precision", "fp8"], "invalid choice: 'fp8' (choose from 'auto', 'bf16-mixed', '16-mixed', '32-true')"),
    (["--workers", "-1"], "'-1' is not valid; use 'auto', 'tuned' or an integer >= 0"),
    (["--model", "resnet"], "invalid choice: 'resnet' (choose from 'convnet', 'mlp')"),
    (["--lr", "0"], "lr=0.0 is not valid; use a positive learning rate"),
    (["--device", "tpu"], "device='tpu' is not valid; use 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    (["--grad-clip", "big"], "'big' is not valid for --grad-clip; expected float or 'none'"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--epochs", "0"], "epochs=0 is not valid; use a positive integer"),
])
def test_bad_input_exits_2_naming_the_value(tiny_images: Path, capsys: pytest.CaptureFixture[str],
                                            argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(small(tiny_images, *argv))
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("layout", "message"), [
    ("missing", "does not exist"),
    ("no-train", "has no 'train' folder"),
    ("empty-train", "no images"),
])
def test_bad_data_folder_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: str, message: str) -> None:
    root = tmp_path / "data"
    if layout != "missing":
        root.mkdir()
    if layout == "empty-train":
        (root / "train" / "cats").mkdir(parents=True)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--data", str(root)])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_train_defaults_to_the_demo_dataset(demo_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    assert main(["train", "--epochs", "1", "--limit-batches", "3", "--limit-val-batches", "1", "--no-progress",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["steps"] == 3
    assert any(demo_cache.glob("demo-*-quick-seed0/train"))


def test_sigterm_stops_saves_and_exits_143(tiny_images: Path, tmp_path: Path) -> None:
    """A real process, preempted mid-run: it finishes the step, writes last.pt and exits 143."""
    ckpt = tmp_path / "ck"
    argv = [sys.executable, "-m", "trainfast", *small(tiny_images, "--epochs", "200", "--checkpoint-dir", str(ckpt),
                                                      "--log-interval-s", "0.2", "--progress")]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        for line in proc.stderr:  # wait until it is really training
            if " step " in line or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[1]
    finally:
        proc.kill() if proc.poll() is None else None
    assert proc.returncode == 143, rest
    state = torch.load(ckpt / "last.pt", weights_only=True)
    assert state["step"] > 0 and state["epoch"] < 200
    assert "resume with" in rest


def test_module_entry_point_and_version() -> None:
    out = subprocess.run([sys.executable, "-m", "trainfast", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("trainfast ")


# `trainfast demo --quick` (naive vs trainfast on the demo data) runs end to end as the demo part of
# benchmarks/gpu.sh, whose report tests/integration/test_gpu_script.py checks.
