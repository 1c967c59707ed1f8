"""trainfast keeps the accelerator fed: it measures, tunes and trains PyTorch models with every speed practice on."""

import logging as _logging

from trainfast import _import_clock  # noqa: F401  (first: it times trainfast's own import)
from trainfast.data import ImageFolder, PackedImages, build_model, ensure_demo_dataset, pack
from trainfast.diagnose import Doctor, Report, diagnose
from trainfast.loader import DevicePrefetcher, make_loader
from trainfast.monitor import Monitor
from trainfast.precision import PrecisionPolicy, resolve_precision
from trainfast.trainer import FitResult, TrainConfig, Trainer
from trainfast.tune import TuneResult, find_batch_size, tune_loader
from trainfast.version import __version__

# Like other training libraries: our INFO lines (what "auto" chose, progress) reach stderr unless the
# application has configured logging itself.
_log = _logging.getLogger("trainfast")
if not _logging.getLogger().hasHandlers() and not _log.handlers:
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("trainfast: %(message)s"))
    _log.addHandler(_handler)
    _log.setLevel(_logging.INFO)
    _log.propagate = False

__all__ = ["DevicePrefetcher", "Doctor", "FitResult", "ImageFolder", "Monitor", "PackedImages", "PrecisionPolicy",
           "Report", "TrainConfig", "Trainer", "TuneResult", "__version__", "build_model", "diagnose",
           "ensure_demo_dataset", "find_batch_size", "make_loader", "pack", "resolve_precision", "tune_loader"]
