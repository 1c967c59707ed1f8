"""Training: `Trainer`, its frozen `TrainConfig`, callbacks and crash-safe checkpoints."""

from trainfast.trainer.checkpoint import CheckpointError, CheckpointWriteError, atomic_save, load_checkpoint
from trainfast.trainer.config import ConfigError, TrainConfig
from trainfast.trainer.loop import NonFiniteLossError, Trainer, TrainingOutOfMemoryError
from trainfast.trainer.result import FitResult

__all__ = ["CheckpointError", "CheckpointWriteError", "ConfigError", "FitResult", "NonFiniteLossError", "TrainConfig",
           "Trainer", "TrainingOutOfMemoryError", "atomic_save", "load_checkpoint"]
