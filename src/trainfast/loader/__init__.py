"""Input pipeline: `make_loader` (the one "auto" resolver), the in-memory path, `DevicePrefetcher`."""

from trainfast.loader.auto import LoaderPlan, plan_loader
from trainfast.loader.make import Loader, make_loader
from trainfast.loader.memory import TensorLoader
from trainfast.loader.prefetch import DevicePrefetcher

__all__ = ["DevicePrefetcher", "Loader", "LoaderPlan", "TensorLoader", "make_loader", "plan_loader"]
