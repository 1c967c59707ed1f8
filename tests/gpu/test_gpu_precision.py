"""precision="auto" on the GPU: bf16 autocast with TF32 on Ampere and newer (an H200 is capability 9.0),
fp16 with a loss scaler before; a short training run under it."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainfast import TrainConfig, Trainer, make_loader
from trainfast.loader.seeding import seed_all
from trainfast.precision.policy import device_caps, resolve_precision

AMPERE = (8, 0)


def expected_auto() -> tuple[str, torch.dtype, bool, bool]:
    """(name, autocast dtype, needs a scaler, TF32) that "auto" must pick on this GPU."""
    capability = torch.cuda.get_device_capability(0)
    if capability >= AMPERE and torch.cuda.is_bf16_supported():
        return "bf16-mixed", torch.bfloat16, False, True
    return "16-mixed", torch.float16, True, capability >= AMPERE


@pytest.mark.gpu
def test_auto_precision_on_this_gpu() -> None:
    caps = device_caps(torch.device("cuda", 0))
    assert caps.device_type == "cuda" and caps.capability == torch.cuda.get_device_capability(0)
    if "H200" in torch.cuda.get_device_name(0) or "H100" in torch.cuda.get_device_name(0):
        assert caps.capability is not None and caps.capability >= (9, 0) and caps.bf16
    policy = resolve_precision("auto", caps)
    name, dtype, scaler, tf32 = expected_auto()
    assert (policy.name, policy.autocast_dtype, policy.needs_scaler, policy.tf32) == (name, dtype, scaler, tf32), \
        policy.reason
    # an explicit fp32 request keeps full-precision matmuls
    assert resolve_precision("32-true", caps).tf32 is False


class Probe(nn.Module):
    """Records the dtype its layers compute in (autocast's choice) on every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 4))
        self.dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        self.dtypes.append(out.dtype)
        return out


class Settings:
    """Reads the TF32 settings while fit runs."""

    def __init__(self) -> None:
        self.inside: tuple[str, bool] | None = None

    def on_fit_start(self, trainer: Trainer) -> None:
        self.inside = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)


@pytest.mark.gpu
def test_auto_precision_trains_on_the_gpu() -> None:
    name, dtype, scaler, tf32 = expected_auto()
    generator = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (128,), generator=generator)
    x = torch.randn(4, 8, generator=generator)[y] * 3 + torch.randn(128, 8, generator=generator)
    seed_all(0)
    model, settings = Probe(), Settings()
    matmul_before = torch.get_float32_matmul_precision()
    trainer = Trainer(model, config=TrainConfig(epochs=2, device="cuda", progress=False, warmup_steps=2),
                      callbacks=[settings])
    assert trainer.precision.name == name and trainer.scaler.enabled is scaler
    result = trainer.fit(make_loader((x, y), 16))
    assert result.steps == 2 * 8
    if not scaler:
        assert result.skipped_steps == 0
    assert result.final_loss is not None and math.isfinite(result.final_loss)
    assert model.dtypes and set(model.dtypes) == {dtype}  # every forward ran under autocast
    assert all(p.dtype == torch.float32 and p.device.type == "cuda" for p in model.parameters())  # fp32 master
    if tf32:
        assert settings.inside == ("high", True), "TF32 was not on during fit"
    assert torch.get_float32_matmul_precision() == matmul_before  # put back when fit ends


class SmallConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                 nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                 nn.Flatten(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


@pytest.mark.gpu
def test_precision_channels_last_and_compile_are_measured_on_the_gpu() -> None:
    """The A/Bs time CUDA steps (device synchronised) and report both settings; compile 'auto' reports its figures
    or the reason it fell back."""
    name, _, scaler, _ = expected_auto()
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(64 * 40, 3, 32, 32, generator=generator), torch.randint(0, 4, (64 * 40,), generator=generator)
    seed_all(0)
    config = TrainConfig(epochs=1, device="cuda", progress=False, compile="auto")
    result = Trainer(SmallConvNet(), config=config).fit(make_loader((x, y), 64)).to_json()
    precision, layout, compiled = result["precision"], result["channels_last"], result["compile"]
    if not scaler:  # bf16 is measured against fp32 (with TF32); fp16 with a scaler is not
        assert precision["measured"] and set(precision["step_s"]) == {name, "32-true"}, precision
        assert all(s > 0 for s in precision["step_s"].values())
    assert layout["measured"] and set(layout["step_s"]) == {"channels_last", "contiguous"}, layout
    assert compiled["eager_step_s"] and compiled["eager_step_s"] > 0, compiled
    if not compiled["reason"].startswith("compilation failed"):
        assert compiled["compiled_step_s"] > 0 and compiled["compile_s"] > 0, compiled
        assert isinstance(compiled["recompiles"], int) and isinstance(compiled["graph_breaks"], int)
    assert math.isfinite(result["final_loss"])
