"""Precision policy resolution (with faked device abilities), TF32 and autocast scopes, and the loss scaler."""

from __future__ import annotations

import io
import re

import pytest
import torch

from trainfast.precision import cpufeatures
from trainfast.precision.policy import (
    PRECISIONS,
    DeviceCaps,
    LossScaler,
    PrecisionPolicy,
    ScalerConfig,
    device_caps,
    resolve_precision,
)

CPU = DeviceCaps("cpu")  # a CPU without native bf16 (faked: not this machine's)
CPU_BF16 = DeviceCaps("cpu", bf16=True, bf16_source="AVX512-BF16")
AMPERE = DeviceCaps("cuda", (8, 0), bf16=True, bf16_source="compute capability 8.0")
HOPPER = DeviceCaps("cuda", (9, 0), bf16=True, bf16_source="compute capability 9.0")
TURING = DeviceCaps("cuda", (7, 5), bf16=False)
VOLTA = DeviceCaps("cuda", (7, 0), bf16=False)


@pytest.mark.parametrize(
    ("requested", "caps", "name", "dtype", "scaler", "tf32"),
    [
        ("auto", CPU, "32-true", None, False, False),
        ("auto", CPU_BF16, "bf16-mixed", torch.bfloat16, False, False),
        ("auto", DeviceCaps("mps"), "32-true", None, False, False),
        ("auto", AMPERE, "bf16-mixed", torch.bfloat16, False, True),
        ("auto", HOPPER, "bf16-mixed", torch.bfloat16, False, True),
        ("auto", TURING, "16-mixed", torch.float16, True, False),
        ("auto", VOLTA, "16-mixed", torch.float16, True, False),
        ("32-true", CPU, "32-true", None, False, False),
        ("32-true", TURING, "32-true", None, False, False),
        ("bf16-mixed", CPU, "bf16-mixed", torch.bfloat16, False, False),
        ("bf16-mixed", CPU_BF16, "bf16-mixed", torch.bfloat16, False, False),
        ("bf16-mixed", AMPERE, "bf16-mixed", torch.bfloat16, False, True),
        ("16-mixed", AMPERE, "16-mixed", torch.float16, True, True),
        ("16-mixed", TURING, "16-mixed", torch.float16, True, False),
    ],
)
def test_resolve_precision_table(requested: str, caps: DeviceCaps, name: str, dtype: torch.dtype | None,
                                 scaler: bool, tf32: bool) -> None:
    policy = resolve_precision(requested, caps)
    assert policy.name == name
    assert policy.device_type == caps.device_type
    assert policy.autocast_dtype == dtype
    assert policy.needs_scaler is scaler
    assert policy.tf32 is tf32
    assert policy.reason
    if requested != "auto":
        assert policy.reason.startswith("requested")
        assert (policy.reason == "requested") is not (requested == "bf16-mixed" and caps == CPU)


def test_auto_explains_its_choice() -> None:
    assert "CPU has no native bf16" in resolve_precision("auto", CPU).reason
    assert "(AVX512-BF16)" in resolve_precision("auto", CPU_BF16).reason
    assert "mps" in resolve_precision("auto", DeviceCaps("mps")).reason
    assert "(8, 0)" in resolve_precision("auto", AMPERE).reason
    assert "GradScaler" in resolve_precision("auto", TURING).reason


@pytest.mark.parametrize("caps", [TURING, VOLTA, DeviceCaps("cuda", None, False)])
def test_bf16_on_a_gpu_without_bf16_suggests_16_mixed(caps: DeviceCaps) -> None:
    with pytest.raises(ValueError, match=rf"precision='bf16-mixed'.*{re.escape(str(caps.capability))}.*Use '16-mixed'"):
        resolve_precision("bf16-mixed", caps)


@pytest.mark.parametrize("requested", ["fp8", "bf16", "fp16", "32", "", "AUTO", "mixed"])
def test_invalid_precision_lists_every_choice(requested: str) -> None:
    choices = ", ".join(repr(p).strip("'") for p in PRECISIONS)
    with pytest.raises(ValueError, match=rf"precision={re.escape(repr(requested))} is not valid; "
                                         rf"choose one of: {re.escape(choices)}"):
        resolve_precision(requested, CPU)


@pytest.mark.parametrize("feature", [None, "AMX-BF16", "AVX512-BF16", "ARM BF16"])
def test_device_caps_on_cpu(monkeypatch: pytest.MonkeyPatch, feature: str | None) -> None:
    monkeypatch.setattr(cpufeatures, "cpu_bf16", lambda: feature)
    assert device_caps(torch.device("cpu")) == DeviceCaps("cpu", None, feature is not None, feature)


@pytest.mark.parametrize(("capability", "bf16"), [((7, 5), False), ((7, 0), False), ((8, 0), True), ((9, 0), True)])
def test_device_caps_counts_only_native_bf16(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int],
                                              bf16: bool) -> None:
    """torch.cuda.is_bf16_supported() says True on pre-Ampere GPUs too ("including_emulation", the default), where
    bf16 is emulated and slow; "auto" must then pick fp16 + GradScaler, not bf16."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    def is_bf16_supported(including_emulation: bool = True) -> bool:  # torch's semantics, without a GPU
        return capability >= (8, 0) or including_emulation

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    caps = device_caps(torch.device("cuda", 0))
    assert caps == DeviceCaps("cuda", capability, bf16, f"compute capability {capability[0]}.{capability[1]}" if bf16
                              else None)
    assert resolve_precision("auto", caps).name == ("bf16-mixed" if bf16 else "16-mixed")


@pytest.mark.parametrize(("requested", "caps", "dtype"), [("bf16-mixed", CPU, torch.bfloat16),
                                                           ("32-true", CPU, torch.float32),
                                                           ("auto", CPU, torch.float32),
                                                           ("auto", CPU_BF16, torch.bfloat16),
                                                           ("32-true", CPU_BF16, torch.float32)])
def test_autocast_on_cpu(requested: str, caps: DeviceCaps, dtype: torch.dtype) -> None:
    policy = resolve_precision(requested, caps)
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with policy.autocast():
        out = a @ b
        linear = torch.nn.functional.linear(a, b.t())
    assert out.dtype == dtype
    assert linear.dtype == dtype
    assert (a @ b).dtype == torch.float32  # only inside the scope
    assert not torch.is_autocast_enabled("cpu")


def test_policy_is_frozen() -> None:
    policy = resolve_precision("auto", CPU)
    assert isinstance(policy, PrecisionPolicy)
    with pytest.raises(AttributeError):
        policy.name = "16-mixed"  # type: ignore[misc]


# --- LossScaler on the CPU ---------------------------------------------------------------------------------


def _setup() -> tuple[torch.nn.Linear, torch.optim.SGD, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.randn(2, 3, generator=gen))
        model.bias.zero_()
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 3, generator=gen)


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_disabled_scaler_is_the_identity_and_steps() -> None:
    model, opt, x = _setup()
    scaler = LossScaler(torch.device("cpu"), enabled=False)
    loss = model(x).pow(2).mean()
    assert scaler.scale(loss) is loss
    assert scaler.loss_scale == 1.0
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    scaler.unscale_(opt)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    before = _params(model)
    calls: list[int] = []
    real_step = opt.step

    def counting_step(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real_step(*args, **kwargs)

    opt.step = counting_step  # type: ignore[method-assign]
    scaler.step(opt)
    assert calls == [1]
    for p, b, g in zip(model.parameters(), before, grads, strict=True):
        assert torch.allclose(p, b - 0.1 * g)
    assert scaler.skipped_steps == 0


def test_enabled_scaler_scales_the_loss_and_unscales_gradients() -> None:
    model, opt, x = _setup()
    ref_model, _, _ = _setup()
    ref_loss = ref_model(x).pow(2).mean()
    ref_loss.backward()
    scaler = LossScaler(torch.device("cpu"), enabled=True, config=ScalerConfig(init_scale=8.0))
    assert scaler.loss_scale == 8.0
    loss = model(x).pow(2).mean()
    scaled = scaler.scale(loss)
    assert torch.allclose(scaled, loss * 8.0)
    scaled.backward()
    for p, r in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.allclose(p.grad, r.grad * 8.0)  # type: ignore[operator]
    scaler.unscale_(opt)
    for p, r in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.allclose(p.grad, r.grad)  # type: ignore[arg-type]


def _scaled_step(scaler: LossScaler, model: torch.nn.Linear, opt: torch.optim.Optimizer, x: torch.Tensor,
                 poison: float | None = None) -> None:
    opt.zero_grad()
    scaler.scale(model(x).pow(2).mean()).backward()
    if poison is not None:
        model.weight.grad[0, 0] = poison  # type: ignore[index]
    scaler.step(opt)


@pytest.mark.parametrize("poison", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_step_is_skipped_and_counted_finite_step_applied(poison: float) -> None:
    model, opt, x = _setup()
    scaler = LossScaler(torch.device("cpu"), enabled=True, config=ScalerConfig(init_scale=8.0))
    before = _params(model)
    _scaled_step(scaler, model, opt, x, poison=poison)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True)), "a skipped step moved"
    assert scaler.skipped_steps == 1
    assert scaler.loss_scale == 4.0  # backed off by 0.5
    _scaled_step(scaler, model, opt, x)
    assert not torch.equal(model.weight, before[0])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert scaler.skipped_steps == 1
    _scaled_step(scaler, model, opt, x, poison=poison)
    assert scaler.skipped_steps == 2
    assert scaler.loss_scale == 2.0


def test_scale_grows_after_growth_interval() -> None:
    model, opt, x = _setup()
    scaler = LossScaler(torch.device("cpu"), enabled=True, config=ScalerConfig(init_scale=8.0, growth_interval=2))
    for _ in range(2):
        _scaled_step(scaler, model, opt, x)
    assert scaler.loss_scale == 16.0
    assert scaler.skipped_steps == 0


@pytest.mark.parametrize("through_torch_save", [False, True])
def test_state_dict_round_trip_keeps_scale_and_skipped_count(through_torch_save: bool) -> None:
    model, opt, x = _setup()
    scaler = LossScaler(torch.device("cpu"), enabled=True, config=ScalerConfig(init_scale=64.0))
    _scaled_step(scaler, model, opt, x, poison=float("inf"))
    _scaled_step(scaler, model, opt, x, poison=float("inf"))
    _scaled_step(scaler, model, opt, x)
    assert (scaler.skipped_steps, scaler.loss_scale) == (2, 16.0)
    state = scaler.state_dict()
    if through_torch_save:
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        state = torch.load(buf, weights_only=True)
    fresh = LossScaler(torch.device("cpu"), enabled=True)
    assert (fresh.skipped_steps, fresh.loss_scale) == (0, 2.0**16)
    fresh.load_state_dict(state)
    assert fresh.skipped_steps == 2
    assert fresh.loss_scale == 16.0
    _scaled_step(scaler, model, opt, x, poison=float("inf"))
    assert scaler.skipped_steps == 3
    assert fresh.skipped_steps == 2  # the loaded state is a copy, not shared


def test_disabled_scaler_state_round_trip() -> None:
    scaler = LossScaler(torch.device("cpu"), enabled=False)
    fresh = LossScaler(torch.device("cpu"), enabled=False)
    fresh.load_state_dict(scaler.state_dict())
    assert (fresh.skipped_steps, fresh.loss_scale) == (0, 1.0)


@pytest.mark.parametrize(
    ("knobs", "shown"),
    [
        ({"init_scale": 0.0}, "init_scale=0.0"),
        ({"init_scale": -1.0}, "init_scale=-1.0"),
        ({"growth_factor": 1.0}, "growth_factor=1.0"),
        ({"growth_factor": 0.5}, "growth_factor=0.5"),
        ({"backoff_factor": 0.0}, "backoff_factor=0.0"),
        ({"backoff_factor": 1.0}, "backoff_factor=1.0"),
        ({"backoff_factor": 1.5}, "backoff_factor=1.5"),
        ({"growth_interval": 0}, "growth_interval=0"),
        ({"growth_interval": -5}, "growth_interval=-5"),
    ],
)
def test_scaler_config_rejects_bad_knobs(knobs: dict[str, float], shown: str) -> None:
    with pytest.raises(ValueError, match=rf"invalid ScalerConfig\(.*{re.escape(shown)}.*\): need init_scale > 0, "
                                         r"growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1"):
        ScalerConfig(**knobs)  # type: ignore[arg-type]


def test_scaler_config_defaults_are_torchs() -> None:
    cfg = ScalerConfig()
    s = torch.amp.GradScaler("cpu")
    assert (cfg.init_scale, cfg.growth_factor, cfg.backoff_factor, cfg.growth_interval) == (
        s.get_scale(), s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval())
    assert ScalerConfig(init_scale=1.0, growth_factor=1.5, backoff_factor=0.9, growth_interval=1).init_scale == 1.0
