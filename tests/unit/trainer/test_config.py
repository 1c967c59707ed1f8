"""`TrainConfig`: defaults, one error per invalid value (naming field and value), from_dict/to_dict."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

import pytest

from trainfast.precision.policy import ScalerConfig
from trainfast.trainer.config import ConfigError, TrainConfig


def test_defaults_are_valid() -> None:
    cfg = TrainConfig()
    assert (cfg.epochs, cfg.accumulate, cfg.log_every) == (1, 1, 50)
    assert cfg.precision == "auto"
    assert cfg.device == "auto"
    assert cfg.channels_last == "auto"
    assert cfg.cpu_threads is None
    assert cfg.grad_clip == 1.0
    assert cfg.scaler == ScalerConfig()


@pytest.mark.parametrize(
    ("field", "value", "fix"),
    [
        ("epochs", 0, "positive integer"),
        ("epochs", -3, "positive integer"),
        ("epochs", 1.5, "positive integer"),
        ("epochs", "2", "positive integer"),
        ("epochs", True, "positive integer"),
        ("epochs", None, "positive integer"),
        ("accumulate", 0, "positive integer"),
        ("accumulate", False, "positive integer"),
        ("log_every", 0, "positive integer"),
        ("limit_batches", 0, "positive integer or None"),
        ("limit_batches", True, "positive integer or None"),
        ("limit_val_batches", -1, "positive integer or None"),
        ("lr", 0, "positive learning rate such as 1e-3"),
        ("lr", -0.1, "positive learning rate such as 1e-3"),
        ("weight_decay", -1, ">= 0"),
        ("warmup_steps", -1, ">= 0"),
        ("grad_clip", 0, "positive norm such as 1.0, or None to disable"),
        ("grad_clip", -1.0, "positive norm such as 1.0, or None to disable"),
        ("precision", "fp8", "choose one of: auto, bf16-mixed, 16-mixed, 32-true"),
        ("precision", "BF16", "choose one of: auto, bf16-mixed, 16-mixed, 32-true"),
        ("device", "tpu", "use 'auto', 'cpu', 'cuda' or 'cuda:N'"),
        ("device", "cuda:x", "use 'auto', 'cpu', 'cuda' or 'cuda:N'"),
        ("device", "cuda:", "use 'auto', 'cpu', 'cuda' or 'cuda:N'"),
        ("device", "cpu:0", "use 'auto', 'cpu', 'cuda' or 'cuda:N'"),
        ("device", "auto:1", "use 'auto', 'cpu', 'cuda' or 'cuda:N'"),
        ("device", "", "use 'auto', 'cpu', 'cuda' or 'cuda:N'"),
        ("device", "CUDA", "use 'auto', 'cpu', 'cuda' or 'cuda:N'"),
        ("cpu_threads", 0, "positive integer, 'auto' or None"),
        ("cpu_threads", -2, "positive integer, 'auto' or None"),
        ("cpu_threads", "many", "positive integer, 'auto' or None"),
        ("cpu_threads", "4", "positive integer, 'auto' or None"),
        ("cpu_threads", 2.5, "positive integer, 'auto' or None"),
        ("channels_last", "yes", "use True, False or 'auto'"),
        ("channels_last", "true", "use True, False or 'auto'"),
        ("channels_last", None, "use True, False or 'auto'"),
    ],
)
def test_invalid_value_names_field_value_and_fix(field: str, value: Any, fix: str) -> None:
    with pytest.raises(ConfigError, match=rf"{re.escape(f'{field}={value!r}')}(?![\w.]).*{re.escape(fix)}"):
        TrainConfig(**{field: value})


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)  # the CLI turns ValueError into a usage error (exit 2)


@pytest.mark.parametrize(("field", "value"), [("lr", math.nan), ("lr", math.inf), ("weight_decay", math.nan),
                                              ("grad_clip", math.nan)])
def test_non_finite_numbers_are_refused(field: str, value: float) -> None:
    """`nan <= 0` is False, so a plain sign check lets NaN through; training would then produce NaN weights."""
    with pytest.raises(ConfigError, match=rf"{field}={value}"):
        TrainConfig(**{field: value})


def test_booleans_are_not_thread_counts() -> None:
    """`True` is an int in Python; epochs rejects it, and so must cpu_threads (it would mean 1 thread)."""
    with pytest.raises(ConfigError, match=r"cpu_threads=True\b.*positive integer"):
        TrainConfig(cpu_threads=True)


@pytest.mark.parametrize(
    "values",
    [
        {"epochs": 3, "accumulate": 4, "log_every": 1},
        {"limit_batches": 1, "limit_val_batches": None},
        {"grad_clip": None},
        {"weight_decay": 0.0, "warmup_steps": 0},
        {"precision": "bf16-mixed"}, {"precision": "16-mixed"}, {"precision": "32-true"},
        {"device": "cpu"}, {"device": "cuda"}, {"device": "cuda:0"}, {"device": "cuda:12"},
        {"cpu_threads": 1}, {"cpu_threads": "auto"}, {"cpu_threads": None},
        {"channels_last": True}, {"channels_last": False},
        {"checkpoint_dir": "runs/x", "compile": True, "progress": False},
    ],
)
def test_valid_values_are_kept(values: dict[str, Any]) -> None:
    cfg = TrainConfig(**values)
    for k, v in values.items():
        assert getattr(cfg, k) == v


def test_config_is_frozen_and_keyword_only() -> None:
    cfg = TrainConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.epochs = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        TrainConfig(2)  # type: ignore[misc]
    assert dataclasses.replace(cfg, epochs=2).epochs == 2
    with pytest.raises(ConfigError, match="epochs=0"):
        dataclasses.replace(cfg, epochs=0)


@pytest.mark.parametrize(("key", "suggestion"), [("epoch", "epochs"), ("learning_rate", None),
                                                 ("gradclip", "grad_clip"), ("precison", "precision"),
                                                 ("cpu_thread", "cpu_threads")])
def test_from_dict_rejects_unknown_keys_with_a_suggestion(key: str, suggestion: str | None) -> None:
    if suggestion is not None:
        pattern = rf"unknown TrainConfig key {key!r}; did you mean {suggestion!r}\?"
    else:
        pattern = rf"unknown TrainConfig key {key!r}; valid keys: epochs, lr, weight_decay, .*scaler"
    with pytest.raises(ConfigError, match=pattern):
        TrainConfig.from_dict({"epochs": 2, key: 1})


def test_from_dict_lists_every_valid_key_when_nothing_is_close() -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict({"zzzzzz": 1})
    message = str(info.value)
    for f in dataclasses.fields(TrainConfig):
        assert f.name in message


def test_from_dict_validates_values() -> None:
    with pytest.raises(ConfigError, match="precision='fp8'"):
        TrainConfig.from_dict({"precision": "fp8"})


def test_from_dict_reports_an_unknown_scaler_key_as_a_config_error() -> None:
    """The nested ScalerConfig dict deserves the same treatment as the top level: ConfigError with a suggestion,
    not a bare TypeError from the dataclass constructor."""
    with pytest.raises(ConfigError, match=r"'scaler.init_scal'.*did you mean 'scaler.init_scale'"):
        TrainConfig.from_dict({"scaler": {"init_scal": 1024.0}})


def test_from_dict_accepts_a_scaler_config_object_and_a_partial_dict() -> None:
    assert TrainConfig.from_dict({"scaler": ScalerConfig(init_scale=4.0)}).scaler.init_scale == 4.0
    cfg = TrainConfig.from_dict({"scaler": {"growth_interval": 7}})
    assert cfg.scaler == ScalerConfig(growth_interval=7)


def test_from_dict_does_not_mutate_its_input() -> None:
    values = {"epochs": 2, "scaler": {"init_scale": 32.0}}
    TrainConfig.from_dict(values)
    assert values == {"epochs": 2, "scaler": {"init_scale": 32.0}}


CUSTOM = TrainConfig(epochs=3, lr=1e-3, weight_decay=0.0, warmup_steps=0, grad_clip=None, accumulate=2,
                     precision="16-mixed", compile=True, channels_last=False, cudnn_benchmark=False, log_every=5,
                     log_interval_s=2.5, checkpoint_dir="runs/a", seed=11, limit_batches=9, limit_val_batches=3,
                     device="cuda:1", cpu_threads="auto", progress=False,
                     scaler=ScalerConfig(init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=10))


@pytest.mark.parametrize("cfg", [TrainConfig(), CUSTOM], ids=["defaults", "custom"])
@pytest.mark.parametrize("through_json", [False, True])
def test_to_dict_from_dict_round_trip(cfg: TrainConfig, through_json: bool) -> None:
    d = cfg.to_dict()
    assert isinstance(d["scaler"], dict)
    assert d["scaler"]["init_scale"] == cfg.scaler.init_scale
    assert set(d) == {f.name for f in dataclasses.fields(TrainConfig)}
    if through_json:
        d = json.loads(json.dumps(d))
    back = TrainConfig.from_dict(d)
    assert back == cfg
    assert isinstance(back.scaler, ScalerConfig)
