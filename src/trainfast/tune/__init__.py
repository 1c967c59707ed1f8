"""Tuning by measurement: the loader/thread configuration (`tune_loader`) and the largest batch (`find_batch_size`)."""

from trainfast.loader.tuned import WorkerSettings
from trainfast.tune.batch_size import BatchSizeError, BatchSizeResult, find_batch_size
from trainfast.tune.result import TuneResult
from trainfast.tune.trial import Trial
from trainfast.tune.tuner import tune_loader

__all__ = ["BatchSizeError", "BatchSizeResult", "Trial", "TuneResult", "WorkerSettings", "find_batch_size",
           "tune_loader"]
