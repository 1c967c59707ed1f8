"""Flags generated from `TrainConfig`: names, conversions, defaults, round trip, and argparse error messages."""

from __future__ import annotations

import argparse
import re
from typing import Any

import pytest

from trainfast.cli.flags import add_config_flags, config_values, positive_int, workers_arg
from trainfast.precision.policy import PRECISIONS, ScalerConfig
from trainfast.trainer.config import ConfigError, TrainConfig


def _parser(**kwargs: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainfast-test")
    add_config_flags(parser, TrainConfig, **kwargs)
    return parser


def _config(argv: list[str], **kwargs: Any) -> TrainConfig:
    return TrainConfig(**config_values(_parser(**kwargs).parse_args(argv), TrainConfig))


def test_one_flag_per_field_and_bools_get_a_negation() -> None:
    flags = {s for a in _parser()._actions for s in a.option_strings}
    for name in ("--epochs", "--lr", "--weight-decay", "--warmup-steps", "--grad-clip", "--accumulate", "--precision",
                 "--channels-last", "--log-every", "--log-interval-s", "--checkpoint-dir", "--seed", "--limit-batches",
                 "--limit-val-batches", "--device", "--cpu-threads"):
        assert name in flags
    for name in ("compile", "cudnn-benchmark", "progress"):
        assert f"--{name}" in flags and f"--no-{name}" in flags
    assert not any("scaler" in f for f in flags)  # nested dataclasses are not flags
    assert "--no-epochs" not in flags


def test_help_shows_the_config_help_and_defaults() -> None:
    text = " ".join(_parser().format_help().split())
    assert "passes over the training data (default: 1)" in text
    assert "(default: 1.0)" in text
    assert "{auto,bf16-mixed,16-mixed,32-true}" in text


def test_no_flags_gives_the_default_config() -> None:
    assert _config([]) == TrainConfig()


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        (["--epochs", "3"], "epochs", 3),
        (["--lr", "1e-3"], "lr", 1e-3),
        (["--grad-clip", "none"], "grad_clip", None),
        (["--grad-clip", "None"], "grad_clip", None),
        (["--grad-clip", "0.5"], "grad_clip", 0.5),
        (["--compile"], "compile", True),
        (["--compile", "auto"], "compile", "auto"),
        (["--compile=yes"], "compile", True),
        (["--compile", "false"], "compile", False),
        (["--no-compile"], "compile", False),
        (["--no-progress"], "progress", False),
        (["--no-cudnn-benchmark"], "cudnn_benchmark", False),
        *[(["--precision", p], "precision", p) for p in PRECISIONS],
        (["--cpu-threads", "auto"], "cpu_threads", "auto"),
        (["--cpu-threads", "none"], "cpu_threads", None),
        (["--cpu-threads", "4"], "cpu_threads", 4),
        (["--channels-last", "true"], "channels_last", True),
        (["--channels-last", "false"], "channels_last", False),
        (["--channels-last", "auto"], "channels_last", "auto"),
        (["--channels-last", "yes"], "channels_last", True),
        (["--channels-last", "0"], "channels_last", False),
        (["--limit-batches", "7"], "limit_batches", 7),
        (["--limit-batches", "none"], "limit_batches", None),
        (["--checkpoint-dir", "runs/a"], "checkpoint_dir", "runs/a"),
        (["--checkpoint-dir", "none"], "checkpoint_dir", None),
        (["--device", "cuda:1"], "device", "cuda:1"),
        (["--seed", "-5"], "seed", -5),
        (["--log-interval-s", "0.5"], "log_interval_s", 0.5),
    ],
)
def test_flag_values_convert_and_round_trip_into_the_config(argv: list[str], field: str, value: Any) -> None:
    cfg = _config(argv)
    got = getattr(cfg, field)
    assert got == value
    assert type(got) is type(value)


def test_many_flags_together_round_trip() -> None:
    argv = ["--epochs", "2", "--lr", "0.01", "--grad-clip", "none", "--compile", "--precision", "16-mixed",
            "--cpu-threads", "3", "--channels-last", "false", "--limit-batches", "5", "--device", "cpu"]
    cfg = _config(argv)
    assert cfg == TrainConfig(epochs=2, lr=0.01, grad_clip=None, compile=True, precision="16-mixed", cpu_threads=3,
                              channels_last=False, limit_batches=5, device="cpu")
    assert cfg.scaler == ScalerConfig()


def test_defaults_override_and_skip() -> None:
    parser = _parser(skip=("seed", "device"), defaults={"cpu_threads": "auto", "epochs": 4})
    args = parser.parse_args([])
    values = config_values(args, TrainConfig, skip=("seed",))
    assert values["cpu_threads"] == "auto"
    assert values["epochs"] == 4
    assert "seed" not in values and "device" not in values  # skipped, or not a flag of this parser
    assert "(default: auto)" in " ".join(parser.format_help().split())
    with pytest.raises(SystemExit):
        parser.parse_args(["--seed", "1"])


def test_config_values_ignores_other_arguments() -> None:
    parser = _parser()
    parser.add_argument("--batch-size", type=positive_int, default=64)
    values = config_values(parser.parse_args(["--batch-size", "8"]), TrainConfig)
    assert "batch_size" not in values
    assert set(values) == {f for f in TrainConfig.__dataclass_fields__ if f != "scaler"}


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["--epochs", "abc"], r"argument --epochs: 'abc' is not valid for --epochs; expected int"),
        (["--epochs", "1.5"], r"'1\.5' is not valid for --epochs; expected int"),
        (["--epochs", "none"], r"'none' is not valid for --epochs; expected int"),
        (["--lr", "fast"], r"'fast' is not valid for --lr; expected float"),
        (["--grad-clip", "off"], r"'off' is not valid for --grad-clip; expected float or 'none'"),
        (["--limit-batches", "all"], r"'all' is not valid for --limit-batches; expected int or 'none'"),
        (["--precision", "fp8"], r"argument --precision: invalid choice: 'fp8' \(choose from .*auto.*bf16-mixed"
                                 r".*16-mixed.*32-true"),
    ],
)
def test_bad_flag_values_exit_2_naming_the_value(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                 shown: str) -> None:
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert re.search(shown, err), err
    assert err.startswith("usage: trainfast-test")


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["--epochs", "0"], "epochs=0"),
        (["--cpu-threads", "many"], "cpu_threads='many'"),
        (["--cpu-threads", "0"], "cpu_threads=0"),
        (["--channels-last", "maybe"], "channels_last='maybe'"),
        (["--compile", "banana"], "compile='banana'"),
        (["--device", "tpu"], "device='tpu'"),
        (["--grad-clip", "0"], "grad_clip=0"),
    ],
)
def test_values_the_flags_pass_on_are_checked_by_the_config(argv: list[str], shown: str) -> None:
    """Flags convert types; ranges and strings are validated once, by TrainConfig (the CLI turns it into exit 2)."""
    with pytest.raises(ConfigError, match=re.escape(shown)):
        _config(argv)


@pytest.mark.parametrize(("text", "value"), [("1", 1), ("64", 64), (" 8 ", 8), ("+3", 3)])
def test_positive_int_accepts(text: str, value: int) -> None:
    assert positive_int(text) == value


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0", "0 is not valid; use a positive integer"),
        ("-4", "-4 is not valid; use a positive integer"),
        ("abc", "'abc' is not an integer; use a positive integer"),
        ("1.5", "'1.5' is not an integer; use a positive integer"),
        ("", "'' is not an integer; use a positive integer"),
    ],
)
def test_positive_int_errors(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{re.escape(message)}$"):
        positive_int(text)


@pytest.mark.parametrize(("text", "value"), [("auto", "auto"), ("0", 0), ("1", 1), ("12", 12)])
def test_workers_arg_accepts(text: str, value: int | str) -> None:
    assert workers_arg(text) == value


@pytest.mark.parametrize("text", ["-1", "many", "Auto", "", "2.5"])
def test_workers_arg_errors(text: str) -> None:
    expected = f"{text!r} is not valid; use 'auto', 'tuned' or an integer >= 0 (0 loads in the main process)"
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{re.escape(expected)}$"):
        workers_arg(text)


@pytest.mark.parametrize(("flag", "arg_type", "text", "shown"), [
    ("--batch-size", positive_int, "0", "argument --batch-size: 0 is not valid; use a positive integer"),
    ("--batch-size", positive_int, "big", "argument --batch-size: 'big' is not an integer"),
    ("--workers", workers_arg, "-2", "argument --workers: '-2' is not valid; use 'auto', 'tuned' or an integer >= 0"),
])
def test_type_helpers_exit_2_through_argparse(capsys: pytest.CaptureFixture[str], flag: str, arg_type: Any,
                                               text: str, shown: str) -> None:
    parser = argparse.ArgumentParser(prog="p")
    parser.add_argument(flag, type=arg_type)
    with pytest.raises(SystemExit) as info:
        parser.parse_args([flag, text])
    assert info.value.code == 2
    assert shown in capsys.readouterr().err
