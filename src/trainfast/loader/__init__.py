"""Input pipeline: `make_loader` (the one "auto" resolver), the in-memory path, `DevicePrefetcher`, and
`LoaderError`, which explains a hung or killed worker, a full /dev/shm or too many open files."""

from trainfast.loader.auto import LoaderPlan, plan_loader
from trainfast.loader.faults import LoaderError
from trainfast.loader.make import Loader, make_loader
from trainfast.loader.memory import TensorLoader
from trainfast.loader.prefetch import DevicePrefetcher

__all__ = ["DevicePrefetcher", "Loader", "LoaderError", "LoaderPlan", "TensorLoader", "make_loader", "plan_loader"]
