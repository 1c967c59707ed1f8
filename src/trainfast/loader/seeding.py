"""Reproducible randomness for data loading.

Every batch's randomness (augmentation draws from `random`, `numpy.random` or `torch`) is seeded
from (seed, epoch, batch number) just before the batch is fetched. So a batch's content depends on
neither the worker that fetched it nor the number of workers, no two batches (hence no two workers)
draw the same numbers — the classic bug is numpy's global RNG forked identically into every worker —
and a run resumed mid-epoch fetches exactly the batches the uninterrupted run would have.
Seeding per worker instead is not enough: with persistent workers, a worker is seeded once, at its
start, and its draws then depend on which batches it happened to be given.

Loader threads (`backend="threads"`) cannot seed the global RNGs: they are shared by every thread of the
process, the training loop's included. Each thread gets its own generators per batch instead, seeded exactly as
the globals would be, and `batch_rngs()` returns the generators of the batch being fetched whatever the backend:
a dataset that draws from them makes the same batches with threads, worker processes or none.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple, cast

import numpy as np
import torch


def derive_seed(*keys: int) -> int:
    """A well-mixed 63-bit seed from integer keys (numpy's SeedSequence hashing)."""
    state = np.random.SeedSequence([k & 0xFFFFFFFFFFFFFFFF for k in keys]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def seed_all(seed: int) -> None:
    """Seed Python's `random`, numpy's global RNG and torch's (CPU and CUDA) RNG."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block with all three global RNGs seeded, then put back the caller's RNG states.

    Fetching in the main process (`num_workers=0`) must not disturb the training RNG stream
    (dropout masks), or results would depend on the worker count.
    """
    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)  # the CPU generator only: torch.manual_seed reseeds the GPUs too
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)


class BatchRNGs(NamedTuple):
    """The random generators seeded for the batch being fetched."""

    random: random.Random
    numpy: np.random.RandomState
    torch: torch.Generator


_thread = threading.local()


def batch_rngs() -> BatchRNGs:
    """The generators seeded for the batch this thread is fetching: in a loader thread (`backend="threads"`) that
    thread's own, elsewhere (no workers, worker processes) the process-global ones, seeded per batch too.

    The same seed gives the same streams either way, so a dataset that draws its augmentation from these (not
    from `random.random()`, `np.random.rand()` or `torch.rand()` directly) makes bit-identical batches with every
    backend and worker count.
    """
    rngs = getattr(_thread, "rngs", None)
    if rngs is not None:
        return cast(BatchRNGs, rngs)
    return BatchRNGs(cast(random.Random, getattr(random, "_inst")),  # noqa: B009 (the module functions' instance)
                     cast(np.random.RandomState, getattr(np.random.mtrand, "_rand")),  # noqa: B009
                     torch.default_generator)


@contextmanager
def thread_seeded(seed: int) -> Iterator[None]:
    """Run a block with this thread's `batch_rngs()` seeded from `seed` (as `seed_all` seeds the globals), leaving
    the process-global RNGs alone."""
    _thread.rngs = BatchRNGs(random.Random(seed), np.random.RandomState(seed % 2**32),
                             torch.Generator().manual_seed(seed))
    try:
        yield
    finally:
        _thread.rngs = None
