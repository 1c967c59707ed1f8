"""Reproducible randomness for data loading.

Every batch's randomness (augmentation draws from `random`, `numpy.random` or `torch`) is seeded
from (seed, epoch, batch number) just before the batch is fetched. So a batch's content depends on
neither the worker that fetched it nor the number of workers, no two batches (hence no two workers)
draw the same numbers — the classic bug is numpy's global RNG forked identically into every worker —
and a run resumed mid-epoch fetches exactly the batches the uninterrupted run would have.
Seeding per worker instead is not enough: with persistent workers, a worker is seeded once, at its
start, and its draws then depend on which batches it happened to be given.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

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
