"""`batch_samples` / `first_leaf`: the one rule for how many samples a batch holds."""

from __future__ import annotations

from collections import OrderedDict, UserDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from trainfast.samples import batch_samples, first_leaf

X8 = torch.zeros(8, 3)


@dataclass
class Batch:
    """What a `collate_fn` may return instead of a tuple or dict."""

    names: list[str]
    images: torch.Tensor
    labels: torch.Tensor


@pytest.mark.parametrize(("batch", "expected"), [
    pytest.param(X8, 8, id="tensor"),
    pytest.param((X8, torch.zeros(8)), 8, id="tuple"),
    pytest.param([torch.zeros(5, 2), torch.zeros(7)], 5, id="list: the first leaf, not the longest"),
    pytest.param({"input_ids": torch.zeros(4, 16, dtype=torch.long), "labels": torch.zeros(4)}, 4, id="dict"),
    pytest.param({"b": torch.zeros(3), "a": torch.zeros(9)}, 3, id="dict: insertion order, not sorted keys"),
    pytest.param(OrderedDict(x=torch.zeros(6)), 6, id="OrderedDict"),
    pytest.param(UserDict({"x": torch.zeros(2, 2)}), 2, id="a Mapping that is not a dict"),
    pytest.param(({"pixels": torch.zeros(2, 3, 4, 4)}, torch.zeros(2)), 2, id="dict in a tuple"),
    pytest.param({"inputs": (torch.zeros(11, 1), torch.zeros(11)), "y": torch.zeros(1)}, 11, id="tuple in a dict"),
    pytest.param((["text"] * 3, {"ids": torch.zeros(3, 5)}), 3, id="strings before the first tensor are skipped"),
    pytest.param(({}, [], (), torch.zeros(12)), 12, id="empty containers are skipped"),
    pytest.param(Batch(["a"] * 6, torch.zeros(6, 3, 4, 4), torch.zeros(6)), 6, id="dataclass: its fields in order"),
    pytest.param({"batch": Batch([], torch.zeros(5, 1), torch.zeros(5))}, 5, id="dataclass in a dict"),
    pytest.param(Batch, 1, id="a dataclass type is not a batch"),
    pytest.param([torch.zeros(242, 3), torch.zeros(377, 3), torch.zeros(318, 3)], 3,
                 id="a ragged list of tensors (point clouds): one sample each"),
    pytest.param(([torch.zeros(5, 3), torch.zeros(9, 3)], torch.zeros(2)), 2, id="a ragged list in a tuple"),
    pytest.param([torch.zeros(35, 20), torch.zeros(20)], 35, id="(x, lengths): two ranks, not ragged"),
    pytest.param([torch.zeros(8, 3), torch.zeros(8, 3)], 8, id="same shapes: a batch dimension"),
    pytest.param([torch.zeros(8, 3), torch.zeros(6, 4)], 8, id="other trailing dims: not one kind of sample"),
    pytest.param([torch.zeros(5, 3), torch.zeros(9, 3), torch.zeros(4)], 5, id="a later tensor of another rank"),
    pytest.param([torch.zeros(5, 3), "label"], 5, id="a tensor and a string: not ragged"),
    pytest.param(np.zeros((10, 2)), 10, id="numpy array"),
    pytest.param({"x": np.zeros(7)}, 7, id="numpy array in a dict"),
    pytest.param(torch.tensor(3.0), 1, id="0-dim tensor: the default"),
    pytest.param((torch.tensor(3), torch.zeros(8)), 1, id="a 0-dim first leaf decides: the default"),
    pytest.param(["a", "b"], 1, id="no tensor: the default"),
    pytest.param({}, 1, id="empty dict: the default"),
    pytest.param(None, 1, id="None: the default"),
    pytest.param("abc", 1, id="a string is not looked into"),
    pytest.param(torch.Size([4, 5]), 1, id="torch.Size is a tuple of ints, not a tensor"),
])
def test_batch_samples(batch: Any, expected: int) -> None:
    assert batch_samples(batch) == expected


def test_the_default_is_used_only_without_a_dimensioned_tensor() -> None:
    assert batch_samples(["no", "tensor"], default=32) == 32
    assert batch_samples(torch.tensor(1.0), default=0) == 0
    assert batch_samples({"x": torch.zeros(4)}, default=32) == 4


def test_first_leaf_returns_the_leaf_itself() -> None:
    ids = torch.zeros(2, 3)
    assert first_leaf(({"ids": ids}, torch.zeros(2))) is ids
    assert first_leaf(("a", 1, 2.0)) is None
