"""Per-batch seeding through `make_loader`: draws depend on (seed, epoch, batch) only, never on the workers.

The dataset is `helpers.Draws`, importable by name as 'spawn' workers need.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from helpers import GLOBAL_RNGS, Draws, assert_same
from trainfast.loader import Loader, make_loader
from trainfast.loader.seeding import derive_seed, seed_all, seeded

IDX, NP, PY, TORCH = range(4)  # columns of a `Draws(n, GLOBAL_RNGS)` sample


def draws_loader(workers: int, *, seed: int = 3, n: int = 24, batch_size: int = 4, **kwargs: Any) -> Loader:
    loader = make_loader(Draws(n, GLOBAL_RNGS, dtype=torch.float64), batch_size, workers=workers, device="cpu",
                         seed=seed, **kwargs)
    assert isinstance(loader, Loader)
    assert loader.plan.num_workers == workers
    return loader


def column(batches: list[torch.Tensor], col: int) -> list[float]:
    return torch.cat(batches)[:, col].tolist()


def assert_all_distinct(values: list[float]) -> None:
    assert len(set(values)) == len(values), "two samples drew the same random number"


@pytest.fixture
def closing() -> Iterator[Callable[[Loader], Loader]]:
    """Shut persistent workers down at the end of the test (else their queue threads outlive it)."""
    loaders: list[Loader] = []
    yield lambda loader: loaders.append(loader) or loader  # type: ignore[func-returns-value]
    for loader in loaders:
        loader.close()


@pytest.fixture(scope="module")
def main_process_epochs() -> list[list[torch.Tensor]]:
    """Two epochs fetched in the main process (workers=0): the reference for every worker setup."""
    loader = draws_loader(0)
    return [list(loader), list(loader)]


def test_persistent_workers_never_share_draws(closing: Callable[[Loader], Loader],
                                              main_process_epochs: list[list[torch.Tensor]]) -> None:
    loader = closing(draws_loader(2, persistent_workers=True, multiprocessing_context="fork"))
    assert loader.plan.persistent_workers
    epochs = [list(loader), list(loader)]
    for e in epochs:
        assert len(e) == 6
        assert sorted(column(e, IDX)) == list(range(24))  # every sample once per epoch
    every = epochs[0] + epochs[1]
    for col in (NP, PY, TORCH):
        assert_all_distinct(column(every, col))
    for got, want in zip(epochs, main_process_epochs, strict=True):
        assert_same(got, want)  # the worker count does not change a single draw


def test_two_workers_match_the_main_process(main_process_epochs: list[list[torch.Tensor]]) -> None:
    """With 'fork'; tests/unit/faults/test_fault_start_methods.py makes the same checks under 'spawn'."""
    loader = draws_loader(2, persistent_workers=False, multiprocessing_context="fork")
    got = list(loader)
    assert_same(got, main_process_epochs[0])
    for col in (NP, PY, TORCH):
        assert_all_distinct(column(got, col))


def test_same_seed_same_batches_in_fresh_loaders() -> None:
    a = list(draws_loader(2, persistent_workers=False, seed=9))
    np.random.seed(1)
    random.seed(1)
    torch.manual_seed(1)  # the caller's global RNG state plays no part
    b = list(draws_loader(2, persistent_workers=False, seed=9))
    assert_same(a, b)
    c = list(draws_loader(0, seed=10))
    assert not set(column(a, NP)) & set(column(c, NP))


@pytest.mark.parametrize("shuffle", [True, False])
def test_each_epoch_draws_new_numbers(shuffle: bool) -> None:
    loader = draws_loader(0, shuffle=shuffle)
    e0, e1 = list(loader), list(loader)
    for col in (NP, PY, TORCH):
        assert not set(column(e0, col)) & set(column(e1, col))


def test_batches_depend_on_batch_not_on_the_samples_before() -> None:
    """Batch b's draws are the same whether or not batches 0..b-1 were fetched (resume)."""
    full = list(draws_loader(0))
    resumed = draws_loader(0)
    resumed.start_at(4)
    assert_same(list(resumed), full[4:])


def _rng_states() -> tuple[torch.Tensor, Any, Any]:
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _assert_rng_states_equal(before: tuple[torch.Tensor, Any, Any], after: tuple[torch.Tensor, Any, Any]) -> None:
    assert torch.equal(before[0], after[0]), "the global torch RNG moved"
    np_before, np_after = before[1], after[1]
    assert np_before[0] == np_after[0] and np.array_equal(np_before[1], np_after[1])
    assert tuple(np_before[2:]) == tuple(np_after[2:]), "numpy's global RNG moved"
    assert before[2] == after[2], "Python's random moved"


def test_main_process_fetch_leaves_caller_rng_alone() -> None:
    seed_all(1234)
    before = _rng_states()
    loader = draws_loader(0)
    for _ in range(2):
        for _batch in loader:
            pass
    _assert_rng_states_equal(before, _rng_states())


def test_worker_fetch_does_not_consume_caller_rng(closing: Callable[[Loader], Loader]) -> None:
    seed_all(4321)
    before = _rng_states()
    loader = closing(draws_loader(2, persistent_workers=True))
    for _ in range(2):
        for _batch in loader:
            pass
    _assert_rng_states_equal(before, _rng_states())


@pytest.mark.gpu
def test_main_process_fetch_leaves_cuda_rng_alone() -> None:
    """Dropout on the GPU draws from the CUDA generator: fetching with workers=0 must not reseed it."""
    torch.cuda.manual_seed_all(99)
    before = torch.cuda.get_rng_state()
    for _batch in draws_loader(0):
        pass
    assert torch.equal(torch.cuda.get_rng_state(), before), "fetching in the main process reseeded the CUDA RNG"


# -------------------------------------------------------------------------------------------------------- seeding.py

def test_derive_seed_is_stable_and_mixed() -> None:
    assert derive_seed(0, 1, 2) == derive_seed(0, 1, 2)
    seeds = {derive_seed(s, e, r, b) for s in range(2) for e in range(3) for r in range(2) for b in range(5)}
    assert len(seeds) == 2 * 3 * 2 * 5
    assert all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(-1) == derive_seed(2**64 - 1)  # negative keys wrap instead of raising


def test_seeded_restores_states_and_is_reproducible() -> None:
    seed_all(5)
    before = _rng_states()
    with seeded(77):
        first = (random.random(), float(np.random.random()), float(torch.rand(())))
    _assert_rng_states_equal(before, _rng_states())
    with seeded(77):
        again = (random.random(), float(np.random.random()), float(torch.rand(())))
    assert first == again


def test_seeded_restores_states_after_an_error() -> None:
    before = _rng_states()
    with pytest.raises(KeyError), seeded(3):
        np.random.random()
        raise KeyError("boom")
    _assert_rng_states_equal(before, _rng_states())
