"""`TrainConfig`: every Trainer setting, validated once; the CLI's flags are generated from it."""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any

from trainfast.device import device_kind
from trainfast.precision.policy import PRECISIONS, ScalerConfig
from trainfast.trainer.signals import parse_signals

STRATEGIES = ("auto", "ddp", "fsdp")
FP16_REFUSED = ("strategy='fsdp' does not train in precision '16-mixed': fp16's loss scaler must find an inf or NaN "
                "in any rank's gradient shard, and torch's GradScaler checks only this rank's. Use "
                "precision='bf16-mixed' (no loss scaler) or '32-true', or strategy='ddp'")


def _opt(help: str, **extra: Any) -> dict[str, Any]:
    return {"help": help, **extra}


class ConfigError(ValueError):
    """A setting has a value that cannot work; the message names it, the valid choices and the fix."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    epochs: int = field(default=1, metadata=_opt("passes over the training data"))
    lr: float = field(default=2e-3, metadata=_opt("peak learning rate (AdamW, after warm-up)"))
    weight_decay: float = field(default=0.05, metadata=_opt("AdamW weight decay (matrices and kernels only)"))
    warmup_steps: int = field(default=20, metadata=_opt("linear warm-up steps before the cosine decay"))
    grad_clip: float | None = field(default=1.0,
                                    metadata=_opt("clip the gradient norm to this (unscaled); none disables"))
    accumulate: int = field(default=1, metadata=_opt("micro-batches per optimizer step (gradient accumulation)"))
    precision: str = field(default="auto", metadata=_opt("numeric precision", choices=PRECISIONS))
    compile: bool | str = field(default=False, metadata=_opt(
        "torch.compile the model: true, false, or 'auto' (time eager vs compiled steps on the first steps and keep "
        "the compiled model only if it is faster and repays its compile time within the run)", bare=True))
    channels_last: bool | str = field(
        default="auto",
        metadata=_opt("NHWC memory format: true, false, or 'auto' (conv nets on the CPU or with mixed precision)"))
    cudnn_benchmark: bool = field(default=True, metadata=_opt("let cuDNN pick the fastest conv algorithms (CUDA)"))
    log_every: int = field(default=50, metadata=_opt("read metrics from the device every N optimizer steps"))
    log_interval_s: float = field(default=10.0,
                                  metadata=_opt("seconds between log lines when stderr is not a terminal"))
    checkpoint_dir: str | None = field(default=None, metadata=_opt("write last.pt and best.pt here"))
    stop_signals: str = field(default="SIGTERM", metadata=_opt(
        "signals that stop training after the current step with a checkpoint, e.g. 'SIGTERM,SIGUSR1' (SLURM)"))
    keep_checkpoints: int = field(default=2, metadata=_opt(
        "recent checkpoints kept (last.pt, last.1.pt, ...): resume falls back past a corrupt one"))
    seed: int | None = field(default=None, metadata=_opt(
        "seed Python, numpy and torch RNGs when a fresh fit starts (dropout etc.); none leaves them alone. "
        "The CLI also seeds weight init and the loader's order and augmentation with it"))
    limit_batches: int | None = field(default=None, metadata=_opt("train on at most N batches per epoch"))
    limit_val_batches: int | None = field(default=None, metadata=_opt("validate on at most N batches"))
    device: str = field(default="auto", metadata=_opt("'auto', 'cpu', 'cuda' or 'cuda:N'"))
    cpu_threads: int | str | None = field(
        default=None,
        metadata=_opt("intra-op threads: N, 'auto' (split cores with loader workers), none = leave torch's"))
    progress: bool = field(default=True, metadata=_opt("show a progress bar on a terminal, log lines otherwise"))
    monitor: bool = field(default=False, metadata=_opt(
        "sample CPU, memory, workers and GPUs in a background thread; the summary lands in the result"))
    tensorboard: str | None = field(default=None, metadata=_opt(
        "write TensorBoard scalars to this folder: train/loss, train/lr, train/samples_per_s, "
        "train/data_wait_fraction and train/mfu at each log point, val/* at each epoch's end (rank 0; needs "
        "pip install 'trainfast[tensorboard]')"))
    scaler: ScalerConfig = field(default_factory=ScalerConfig, metadata=_opt("GradScaler knobs (16-mixed)"))
    strategy: str = field(default="auto", metadata=_opt(
        "under torchrun: 'ddp' (every rank holds the whole model), 'fsdp' (parameters, gradients and optimizer "
        "state sharded over the ranks: FSDP2's fully_shard on the repeated blocks and the root; checkpoints then "
        "written by every rank through torch.distributed.checkpoint) or 'auto' (DDP while they fit the device "
        "with room, else FSDP; the log says why). No effect in a single process", choices=STRATEGIES))

    def __post_init__(self) -> None:
        _positive(self, "epochs", "accumulate", "log_every", "keep_checkpoints")
        _positive(self, "limit_batches", "limit_val_batches", optional=True)
        # `not x > 0` rather than `x <= 0`: NaN compares false either way and must be refused too
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"lr={self.lr} is not valid; use a positive learning rate such as 1e-3")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError(f"weight_decay={self.weight_decay} is not valid; use a number >= 0 such as 0.05")
        if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0):
            raise ConfigError(f"warmup_steps={self.warmup_steps!r} is not valid; use an integer >= 0")
        if self.grad_clip is not None and not (math.isfinite(self.grad_clip) and self.grad_clip > 0):
            raise ConfigError(f"grad_clip={self.grad_clip} is not valid; use a positive norm such as 1.0, "
                              "or None to disable")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy={self.strategy!r} is not valid; choose one of: {', '.join(STRATEGIES)}")
        if self.strategy == "fsdp" and self.precision == "16-mixed":
            raise ConfigError(FP16_REFUSED)
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r} is not valid; choose one of: {', '.join(PRECISIONS)}")
        try:
            device_kind(self.device)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.compile not in (True, False, "auto"):
            raise ConfigError(f"compile={self.compile!r} is not valid; use True, False or 'auto'")
        if self.channels_last not in (True, False, "auto"):
            raise ConfigError(f"channels_last={self.channels_last!r} is not valid; use True, False or 'auto'")
        try:
            parse_signals(self.stop_signals)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        t = self.cpu_threads
        if not (t is None or t == "auto" or (isinstance(t, int) and not isinstance(t, bool) and t >= 1)):
            raise ConfigError(f"cpu_threads={t!r} is not valid; use a positive integer, 'auto' or None")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """Build from a plain dict (a config file, a checkpoint); unknown keys are errors, with suggestions."""
        _check_keys(cls, values)
        values = dict(values)
        if isinstance(values.get("scaler"), dict):
            values["scaler"] = _build(ScalerConfig, values["scaler"], "scaler.")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_keys(cls: type, values: dict[str, Any], prefix: str = "") -> None:
    names = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {prefix + close[0]!r}?" if close else f"; valid keys: {', '.join(names)}"
            raise ConfigError(f"unknown {cls.__name__} key {prefix + key!r}{hint}")


def _build(cls: type, values: dict[str, Any], prefix: str) -> Any:
    _check_keys(cls, values, prefix)
    try:
        return cls(**values)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _positive(cfg: TrainConfig, *names: str, optional: bool = False) -> None:
    for name in names:
        value = getattr(cfg, name)
        if optional and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            choices = "a positive integer" + (" or None" if optional else "")
            raise ConfigError(f"{name}={value!r} is not valid; use {choices}")
