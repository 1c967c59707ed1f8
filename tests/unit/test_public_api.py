"""The public API, pinned: `trainfast.__all__` and every subpackage's `__all__` exactly as published, each name
importable and of the kind the Python API tour (docs/python-api.md; or, for names it does not show, the code) says it
is.

A deliberate change to the public API must update the lists here; an accidental one fails.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import typing
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

import trainfast

# The kinds a public name can be.
CLASS, EXCEPTION, FUNCTION, CONSTANT, LITERAL_ALIAS, VERSION = (
    "class", "exception", "function", "constant", "Literal alias", "version string")

# trainfast.__all__ as it is today, in its order, with each name's kind: 19 names and `__version__`. The Python
# API tour shows `ImageFolder`, `DevicePrefetcher`, `Trainer`, `TrainConfig`, `Doctor` and `Monitor` as classes
# and `make_loader`, `ensure_demo_dataset`, `build_model`, `diagnose` and `find_batch_size` as functions;
# `FitResult`, `Report` and `TuneResult` are what `fit`, `diagnose` and `tune` return (dataclasses); `pack` writes
# and `PackedImages` reads packed JPEG shards (docs/command-line.md: "Packing a dataset").
TOP_LEVEL: dict[str, str] = {
    "DevicePrefetcher": CLASS,
    "Doctor": CLASS,
    "FitResult": CLASS,
    "ImageFolder": CLASS,
    "Monitor": CLASS,
    "PackedImages": CLASS,
    "PrecisionPolicy": CLASS,
    "Report": CLASS,
    "TrainConfig": CLASS,
    "Trainer": CLASS,
    "TuneResult": CLASS,
    "__version__": VERSION,
    "build_model": FUNCTION,
    "diagnose": FUNCTION,
    "ensure_demo_dataset": FUNCTION,
    "find_batch_size": FUNCTION,
    "make_loader": FUNCTION,
    "pack": FUNCTION,
    "resolve_precision": FUNCTION,
    "tune_loader": FUNCTION,
}

# Where each top-level name comes from: the top level re-exports the subpackages' objects, it defines none.
TOP_LEVEL_HOME: dict[str, str] = {
    "DevicePrefetcher": "trainfast.loader",
    "Doctor": "trainfast.diagnose",
    "FitResult": "trainfast.trainer",
    "ImageFolder": "trainfast.data",
    "Monitor": "trainfast.monitor",
    "PackedImages": "trainfast.data",
    "PrecisionPolicy": "trainfast.precision",
    "Report": "trainfast.diagnose",
    "TrainConfig": "trainfast.trainer",
    "Trainer": "trainfast.trainer",
    "TuneResult": "trainfast.tune",
    "build_model": "trainfast.data",
    "diagnose": "trainfast.diagnose",
    "ensure_demo_dataset": "trainfast.data",
    "find_batch_size": "trainfast.tune",
    "make_loader": "trainfast.loader",
    "pack": "trainfast.data",
    "resolve_precision": "trainfast.precision",
    "tune_loader": "trainfast.tune",
}

# Every module of the package that defines `__all__` (grep "__all__" src/trainfast), in its order, with kinds.
SUBPACKAGES: dict[str, dict[str, str]] = {
    "trainfast.data": {
        "MODELS": CONSTANT,
        "CorruptImageError": EXCEPTION,
        "ImageFolder": CLASS,
        "Normalize": CLASS,
        "PackResult": CLASS,
        "PackedImages": CLASS,
        "build_model": FUNCTION,
        "ensure_demo_dataset": FUNCTION,
        "pack": FUNCTION,
    },
    "trainfast.diagnose": {
        "VERDICTS": CONSTANT,
        "Doctor": CLASS,
        "DoctorRun": CLASS,
        "Fractions": CLASS,
        "Recommendation": CLASS,
        "Report": CLASS,
        "Verdict": CLASS,
        "classify": FUNCTION,
        "diagnose": FUNCTION,
        "recommend": FUNCTION,
        "run_doctor": FUNCTION,
    },
    "trainfast.envcheck": {
        "CONTRACT_FIELDS": CONSTANT,
        "Check": CLASS,
        "Status": LITERAL_ALIAS,
        "bug_report_block": FUNCTION,
        "cpu_check": FUNCTION,
        "cuda_alloc_conf_check": FUNCTION,
        "cuda_versions_check": FUNCTION,
        "db_handles_check": FUNCTION,
        "environment": FUNCTION,
        "estimate_batch_bytes": FUNCTION,
        "find_handles": FUNCTION,
        "loader_settings": FUNCTION,
        "nvml_check": FUNCTION,
        "open_files_check": FUNCTION,
        "preflight": FUNCTION,
        "read_cuda_alloc_conf": FUNCTION,
        "read_driver_version": FUNCTION,
        "read_open_files_limit": FUNCTION,
        "read_shm_bytes": FUNCTION,
        "read_tf32_settings": FUNCTION,
        "shm_check": FUNCTION,
        "tensors_batch_bytes": FUNCTION,
        "tf32_check": FUNCTION,
        "versions_check": FUNCTION,
    },
    "trainfast.loader": {
        "DevicePrefetcher": CLASS,
        "Loader": CLASS,
        "LoaderError": EXCEPTION,
        "LoaderOptions": CLASS,
        "LoaderPlan": CLASS,
        "LoaderResolution": CLASS,
        "TensorLoader": CLASS,
        "ThreadLoader": CLASS,
        "build_loader": FUNCTION,
        "make_loader": FUNCTION,
        "plan_loader": FUNCTION,
        "resolve_loader": FUNCTION,
    },
    "trainfast.loader.faults": {
        "FailureKind": LITERAL_ALIAS,
        "LoaderError": EXCEPTION,
        "explain_failure": FUNCTION,
        "fit_shared_memory": FUNCTION,
        "read_memory": FUNCTION,
        "read_open_files_limit": FUNCTION,
        "read_shm_bytes": FUNCTION,
    },
    "trainfast.monitor": {
        "FakeSource": CLASS,
        "Monitor": CLASS,
        "NvmlSource": CLASS,
        "PsutilSource": CLASS,
        "Source": CLASS,
        "Stats": CLASS,
        "TorchCudaSource": CLASS,
        "detect_sawtooth": FUNCTION,
        "growth_per_minute": FUNCTION,
        "percentile": FUNCTION,
        "stats": FUNCTION,
        "sustained_growth_per_minute": FUNCTION,
    },
    "trainfast.precision": {
        "PRECISIONS": CONSTANT,
        "DeviceCaps": CLASS,
        "LossScaler": CLASS,
        "PrecisionPolicy": CLASS,
        "ScalerConfig": CLASS,
        "device_caps": FUNCTION,
        "resolve_precision": FUNCTION,
    },
    "trainfast.trainer": {
        "CheckpointError": EXCEPTION,
        "CheckpointWriteError": EXCEPTION,
        "ConfigError": EXCEPTION,
        "FitResult": CLASS,
        "NonFiniteLossError": EXCEPTION,
        "TrainConfig": CLASS,
        "Trainer": CLASS,
        "TrainingOutOfMemoryError": EXCEPTION,
        "atomic_save": FUNCTION,
        "load_checkpoint": FUNCTION,
    },
    "trainfast.tune": {
        "BatchSizeError": EXCEPTION,
        "BatchSizeResult": CLASS,
        "Trial": CLASS,
        "TuneResult": CLASS,
        "WorkerSettings": CLASS,
        "find_batch_size": FUNCTION,
        "tune_loader": FUNCTION,
    },
}


def kind_of(obj: object) -> str:
    if inspect.isclass(obj):
        return EXCEPTION if issubclass(obj, BaseException) else CLASS
    if inspect.isfunction(obj):
        return FUNCTION
    if typing.get_origin(obj) is typing.Literal:
        return LITERAL_ALIAS
    if isinstance(obj, str):
        return VERSION
    if isinstance(obj, (tuple, frozenset, dict)):
        return CONSTANT
    return type(obj).__name__


def star_import(module: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    exec(f"from {module} import *", namespace)  # what `from module import *` really binds
    del namespace["__builtins__"]
    return namespace


def test_top_level_all_is_exactly_the_published_list() -> None:
    assert trainfast.__all__ == list(TOP_LEVEL)
    assert trainfast.__all__ == sorted(trainfast.__all__)
    assert len([name for name in trainfast.__all__ if name != "__version__"]) == 19


def test_every_top_level_name_is_importable_and_of_its_documented_kind() -> None:
    namespace = star_import("trainfast")
    assert set(namespace) == set(TOP_LEVEL)
    for name, kind in TOP_LEVEL.items():
        assert namespace[name] is getattr(trainfast, name)
        assert kind_of(namespace[name]) == kind, name


def test_top_level_names_are_the_subpackages_objects() -> None:
    for name, home in TOP_LEVEL_HOME.items():
        assert getattr(trainfast, name) is getattr(importlib.import_module(home), name), name
        assert name in importlib.import_module(home).__all__, name


def test_version_is_the_installed_distributions() -> None:
    assert trainfast.__version__ == importlib.metadata.version("trainfast")


@pytest.mark.parametrize("module", list(SUBPACKAGES))
def test_subpackage_all_is_exactly_the_published_list(module: str) -> None:
    assert importlib.import_module(module).__all__ == list(SUBPACKAGES[module])


@pytest.mark.parametrize("module", list(SUBPACKAGES))
def test_every_subpackage_name_is_importable_and_of_its_kind(module: str) -> None:
    mod = importlib.import_module(module)
    namespace = star_import(module)
    assert set(namespace) == set(SUBPACKAGES[module])
    for name, kind in SUBPACKAGES[module].items():
        assert namespace[name] is getattr(mod, name)
        assert kind_of(namespace[name]) == kind, f"{module}.{name}"


@pytest.mark.parametrize("module", ["trainfast", *(m for m in SUBPACKAGES if m != "trainfast.loader.faults")])
def test_packages_export_nothing_public_outside_all(module: str) -> None:
    """A package `__init__` that binds a new public name must list it in `__all__` (its submodules aside)."""
    mod: ModuleType = importlib.import_module(module)
    unlisted = [name for name in vars(mod) if not name.startswith("_") and name not in mod.__all__
                and not inspect.ismodule(getattr(mod, name))]
    assert unlisted == []


def test_the_api_tour_call_shapes() -> None:
    """The calls the Python API tour shows (`Trainer(model, optimizer=None, loss_fn=None, config=None,
    callbacks=())`, `make_loader(dataset, batch_size, ...)`, ...) still bind."""

    def head(fn: Any, count: int) -> list[tuple[str, object]]:
        return [(p.name, p.default) for p in list(inspect.signature(fn).parameters.values())[:count]]

    empty = inspect.Parameter.empty
    assert head(trainfast.Trainer, 5) == [("model", empty), ("optimizer", None), ("loss_fn", None),
                                          ("config", None), ("callbacks", ())]
    assert head(trainfast.make_loader, 2) == [("dataset", empty), ("batch_size", empty)]
    assert head(trainfast.find_batch_size, 2) == [("model", empty), ("sample", empty)]
    assert head(trainfast.diagnose, 2) == [("loader", empty), ("step_fn", None)]
    keywords: list[tuple[Callable[..., Any], set[str]]] = [
        (trainfast.diagnose, {"model", "steps"}),
        (trainfast.build_model, {"num_classes", "image_size"}),
        (trainfast.ImageFolder, {"image_size", "train"}),
        (trainfast.TrainConfig, {"epochs", "checkpoint_dir", "cpu_threads", "progress", "precision", "compile",
                                 "monitor", "keep_checkpoints"}),
    ]
    for fn, names in keywords:
        assert names <= set(inspect.signature(fn).parameters), fn
    assert inspect.signature(trainfast.ensure_demo_dataset).parameters["size"].default == "quick"


def test_the_api_tour_methods_and_fields() -> None:
    for context_manager in (trainfast.Doctor, trainfast.Monitor):
        assert callable(context_manager.__enter__) and callable(context_manager.__exit__)
    assert callable(trainfast.Trainer.fit)
    assert callable(trainfast.Report.render) and callable(trainfast.Report.to_json)
    assert callable(trainfast.Monitor.summary)
    fit_fields = {f.name for f in dataclasses.fields(trainfast.FitResult)}
    assert {"samples_per_s", "data_wait_fraction", "val_accuracy"} <= fit_fields
    tune_fields = {f.name for f in dataclasses.fields(trainfast.TuneResult)}
    assert {"chosen", "chosen_samples_per_s", "baseline_samples_per_s", "trials", "sweep_seconds"} <= tune_fields
    for result in (trainfast.FitResult, trainfast.Report, trainfast.TuneResult):
        assert dataclasses.is_dataclass(result), result
    config = trainfast.TrainConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):  # "its frozen TrainConfig" (trainfast.trainer)
        setattr(config, "epochs", 2)  # noqa: B010
