"""Input pipeline: `make_loader` (the one "auto" resolver), the in-memory path, `DevicePrefetcher`, and
`LoaderError`, which explains a hung or killed worker, a full /dev/shm or too many open files.

`make_loader` in three steps: `LoaderOptions` (the settings, validated; CLI flags can be generated from it),
`resolve_loader` (the plan for this dataset on this machine, nothing started) and `build_loader`."""

from trainfast.loader.auto import LoaderPlan, plan_loader
from trainfast.loader.faults import LoaderError
from trainfast.loader.make import Loader, build_loader, make_loader
from trainfast.loader.memory import TensorLoader
from trainfast.loader.options import LoaderOptions
from trainfast.loader.prefetch import DevicePrefetcher
from trainfast.loader.resolve import LoaderResolution, resolve_loader
from trainfast.loader.threads import ThreadLoader

__all__ = ["DevicePrefetcher", "Loader", "LoaderError", "LoaderOptions", "LoaderPlan", "LoaderResolution",
           "TensorLoader", "ThreadLoader", "build_loader", "make_loader", "plan_loader", "resolve_loader"]
