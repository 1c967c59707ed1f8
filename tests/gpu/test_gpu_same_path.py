"""What only a GPU can settle of the defaults whose CPU twins run in the default suite (CONTRIBUTING.md, "Same path
on CPU"): CUDA's fused AdamW under the layout A/B, the CUDA prefetcher's batch containers and layout, TF32's new API,
the CUDA RNG of the training device, the launch environment's GPU checks, the resumed loss scaler, compile's guard
and its later recompiles, NVML and the doctor's cudnn.benchmark advice (that demo and bench run both sides on the
GPU, gpu.sh's demo and bench parts record in their JSON: each run's "device"). The tests that need two GPUs (NCCL) skip
with the reason on one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers import Images, Sample
from trainfast import TrainConfig, Trainer, make_loader
from trainfast.device import resolve_device
from trainfast.loader.prefetch import DevicePrefetcher, Normalize
from trainfast.trainer import practice_kinds, practices
from trainfast.trainer.checkpoint import rng_state, set_rng_state
from trainfast.trainer.settings import torch_settings

pytestmark = pytest.mark.gpu
Doctor = Callable[..., dict[str, Any]]
REPO = Path(__file__).resolve().parents[2]


def two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for 2 NCCL ranks; {torch.cuda.device_count()} visible")




def images(dtype: torch.dtype = torch.uint8) -> Images:
    """256 16 x 16 images in 4 classes."""
    return Images(256, size=16, classes=4, dtype=dtype)


def conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))


def cuda_config(**overrides: Any) -> TrainConfig:
    return TrainConfig(**{"epochs": 1, "progress": False, "device": "cuda", **overrides})


def test_the_default_fused_adamw_survives_every_layout_switch_of_the_ab() -> None:
    """CUDA's fused AdamW raises on a moment whose strides differ from its parameter's: the layout A/B switches the
    model back and forth, and the moments must follow every switch."""
    model = conv_net()
    loader = DataLoader(images(torch.float32), batch_size=8)  # 32 steps: the layout A/B runs
    trainer = Trainer(model, config=cuda_config(precision="32-true", channels_last="auto"))
    assert trainer.optimizer.defaults.get("fused") is True  # the Trainer's default on CUDA
    result = trainer.fit(loader)
    assert result.channels_last is not None and result.channels_last["measured"] is True, result.channels_last
    for p in model.parameters():
        for value in trainer.optimizer.state[p].values():
            if value.dim() == 4:
                assert value.is_contiguous(memory_format=torch.channels_last) == trainer.channels_last


def test_namedtuple_batches_pass_the_cuda_prefetcher() -> None:
    loader = DataLoader(images(), batch_size=16, pin_memory=True)
    batches = list(DevicePrefetcher(loader, "cuda", normalize=Normalize(), channels_last=True))
    assert len(batches) == 16 and all(type(b) is Sample for b in batches)
    first = batches[0]
    assert first.image.is_cuda and first.label.is_cuda and first.image.dtype == torch.float32
    assert first.image.is_contiguous(memory_format=torch.channels_last)


def test_the_default_trainer_trains_on_namedtuple_batches_on_cuda() -> None:
    result = Trainer(conv_net(), config=cuda_config()).fit(DataLoader(images(torch.float32), batch_size=8))
    assert result.steps == 32 and result.final_loss is not None


def test_inputs_follow_a_layout_decided_mid_epoch_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(practice_kinds.ChannelsLast, "decide",
                        lambda self, settings, ab: practices.Choice("channels_last", "contiguous", "decreed"))
    seen: list[bool] = []
    model = conv_net()
    model[0].register_forward_pre_hook(
        lambda m, args: seen.append(args[0].is_contiguous()) if m.training and torch.is_grad_enabled() else None)
    trainer = Trainer(model, config=cuda_config(precision="bf16-mixed", channels_last="auto"))  # prior: NHWC
    assert trainer.channels_last is True
    steps = trainer.fit(DataLoader(images(torch.float32), batch_size=8)).ab_steps["channels_last"]  # when decided
    assert trainer.channels_last is False and steps > 0 and all(seen[steps + 1:]), seen  # (one batch staged ahead)


def test_tf32_set_through_the_new_api_by_a_script_does_not_break_fit() -> None:
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has no fp32_precision API")
    with torch_settings():  # puts the user's (here: the script's) settings back afterwards
        torch.backends.cuda.matmul.fp32_precision = "tf32"  # the new API alone: legacy reads would raise
        x = torch.randn(64, 8)
        y = torch.randint(0, 4, (64,))
        result = Trainer(nn.Linear(8, 4), config=cuda_config(precision="auto")).fit(make_loader((x, y), 16))
        assert result.steps == 4
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # as the script left it


def test_only_the_training_gpus_rng_is_saved_and_restored_there() -> None:
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    torch.cuda.manual_seed_all(7)
    state = rng_state(device)
    assert state["cuda_device"] == device.index and len(state["cuda"]) == 1
    expected = torch.rand(4, device=device)
    torch.cuda.manual_seed_all(99)
    set_rng_state(state, device)
    assert torch.equal(torch.rand(4, device=device), expected)


def test_an_old_checkpoint_saved_with_more_gpus_than_visible_resumes() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.manual_seed_all(7)
    state = rng_state(device)
    expected = torch.rand(4, device=device)
    state.pop("cuda_device")  # as written before: every visible GPU's state, here more than are visible now
    state["cuda"] = [state["cuda"][0]] * (torch.cuda.device_count() + 3)
    torch.cuda.manual_seed_all(99)
    set_rng_state(state, device)  # torch's set_rng_state_all raised IndexError here
    assert torch.equal(torch.rand(4, device=device), expected)


def test_local_rank_beyond_the_visible_gpus_is_an_error_naming_both() -> None:
    count = torch.cuda.device_count()
    env = {"WORLD_SIZE": str(count + 1), "LOCAL_RANK": str(count), "RANK": str(count)}
    with pytest.raises(ValueError, match=rf"LOCAL_RANK={count}.*{count}"):
        resolve_device("auto", env)
    assert resolve_device("cuda", {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "RANK": "0"}) == torch.device("cuda", 0)


def test_an_fp16_checkpoint_resumed_under_auto_on_a_bf16_gpu_keeps_its_loss_scaler(tmp_path: Path) -> None:
    x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
    Trainer(nn.Linear(8, 4), config=cuda_config(precision="16-mixed", checkpoint_dir=str(tmp_path))).fit(
        make_loader((x, y), 16))
    resumed = Trainer(nn.Linear(8, 4), config=cuda_config(epochs=2, precision="auto", checkpoint_dir=str(tmp_path)))
    resumed.fit(make_loader((x, y), 16), resume=True)
    assert resumed.precision.name == "16-mixed" and resumed.scaler.enabled


class Fp32TooBig(nn.Module):
    """Runs out of memory when it trains in fp32 (as a batch size found under bf16 can)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and not torch.is_autocast_enabled("cuda"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB (probe)")
        out: torch.Tensor = self.head(self.conv(x).mean(dim=(2, 3)))
        return out


def test_out_of_memory_in_the_precision_ab_keeps_bf16() -> None:
    if not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU: auto is fp16 with a scaler and no A/B")
    result = Trainer(Fp32TooBig(), config=cuda_config(channels_last=False)).fit(
        DataLoader(images(torch.float32), batch_size=8))
    assert result.precision is not None and result.precision["chosen"] == "bf16-mixed"
    assert "ran out of memory" in result.precision["reason"]


@pytest.mark.torch_compile
def test_compile_auto_on_a_dropout_model_passes_the_loss_guard() -> None:
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Dropout(0.5), nn.Linear(256, 4))
    x, y = torch.randn(40 * 16, 32), torch.randint(0, 4, (40 * 16,))
    result = Trainer(model, config=cuda_config(precision="32-true", compile="auto")).fit(make_loader((x, y), 16))
    assert result.compile is not None and "gave a loss" not in result.compile["reason"], result.compile


@pytest.mark.torch_compile
def test_recompiles_after_the_compile_choice_are_reported() -> None:
    """Validation in eval mode is another graph: compiled after the A/B chose, it is reported."""
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 4))
    x, y = torch.randn(40 * 16, 32), torch.randint(0, 4, (40 * 16,))
    val = make_loader((x[:64], y[:64]), 16, shuffle=False)
    result = Trainer(model, config=cuda_config(precision="32-true", compile=True)).fit(make_loader((x, y), 16), val)
    assert result.compile is not None and result.compile["chosen"] == "compiled"
    assert result.compile["recompiles_after"] is not None and result.compile["recompiles_after"] >= 1, result.compile


def test_nvml_reads_every_visible_gpu() -> None:
    from trainfast.monitor.sources import NvmlSource

    source = NvmlSource()
    try:
        assert source.available, source.unavailable_reason
        assert source.skipped == {}
        assert any(key.endswith(".util") for key in source.sample())
    finally:
        source.close()


def test_the_doctor_does_not_recommend_cudnn_benchmark_to_a_script_that_sets_it(doctor: Doctor) -> None:
    ids = [r["id"] for r in doctor("conv_cudnn_benchmark.py")["recommendations"]]
    assert "cudnn_benchmark" not in ids
    unset = [r["id"] for r in doctor("conv_cudnn_benchmark.py", "--benchmark", "0")["recommendations"]]
    assert "cudnn_benchmark" in unset


def test_fits_in_a_row_under_torchrun_on_nccl(tmp_path: Path) -> None:
    two_gpus()
    script = REPO / "tests" / "integration" / "scripts" / "ddp_fits_in_a_row.py"
    done = _torchrun(str(script), str(tmp_path / "out"), "cuda")
    assert done.returncode == 0, done.stderr[-3000:]


def test_rank_skew_on_nccl_ends_with_the_same_choices(tmp_path: Path) -> None:
    two_gpus()
    script = REPO / "tests" / "integration" / "scripts" / "rank_skew.py"
    done = _torchrun(str(script), "--seed", "0", "--out", str(tmp_path), "--device", "cuda")
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert first["choices"] == second["choices"] and first["weights"] == second["weights"]


def _torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args]
    env = os.environ | {"PYTHONPATH": str(REPO / "src"), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
