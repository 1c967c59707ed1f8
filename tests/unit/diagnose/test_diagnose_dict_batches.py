"""diagnose(loader, model=...) on dict (Hugging Face style) batches: the default step's documented rule, and
samples counted as samples (not batches) in the measured steps and in the loader replay."""

from __future__ import annotations

import importlib
import time
from collections import UserDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainfast import diagnose
from trainfast.diagnose.run.library import _forward_backward, _loader_rate
from trainfast.loader.prefetch import move
from trainfast.samples import batch_samples
from trainfast.trainer.step import mapping_output_loss as _mapping_loss

VOCAB, SEQ = 32, 6


class TokenDataset(Dataset[dict[str, torch.Tensor]]):
    """In-memory token sequences, one dict per sample, as a tokenized Hugging Face dataset yields them."""

    def __init__(self, n: int = 96, labels: bool = True) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.labels = labels

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long)}
        return item | ({"labels": self.ids[i]} if self.labels else {})


@dataclass
class CausalLMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class TinyLM(nn.Module):
    """Hugging Face style: keyword inputs, computes its own loss when given `labels`, returns an output object."""

    def __init__(self, width: int = 16, depth: int = 0) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, width), nn.Linear(width, VOCAB)
        self.body = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)))
        self.labels_seen = 0

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> CausalLMOutput:
        hidden = self.body(self.embed(input_ids) * attention_mask.unsqueeze(-1))  # type: ignore[union-attr]
        logits = self.head(hidden)
        loss = None
        if labels is not None:
            self.labels_seen += 1
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return CausalLMOutput(loss, logits)


class PlainLM(nn.Module):
    """Takes the model inputs but no `labels` and returns plain logits (B, T, V)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids) * attention_mask.unsqueeze(-1))  # type: ignore[no-any-return]


def _grads_after(model: nn.Module) -> list[int]:
    """Counts backward passes that reach the model's first parameter (the step zeroes the grads after)."""
    calls: list[int] = []
    next(model.parameters()).register_hook(lambda g: calls.append(1))
    return calls


def _batch(n: int = 4, labels: bool = True) -> dict[str, torch.Tensor]:
    return next(iter(DataLoader(TokenDataset(labels=labels), batch_size=n)))


def test_diagnose_counts_samples_of_dict_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    replayed: list[int] = []

    def spy(batch: Any, default: int = 1) -> int:
        replayed.append(batch_samples(batch, default))
        return replayed[-1]

    # by module: `trainfast.diagnose` the attribute is the function, which hides the subpackage from dotted paths
    monkeypatch.setattr(importlib.import_module("trainfast.diagnose.run.library"), "batch_samples", spy)
    model = TinyLM(width=256, depth=3)  # ~1 ms a step: clearly slower than collating 8 dicts
    report = diagnose(DataLoader(TokenDataset(256), batch_size=8), model=model, steps=20, warmup=2)
    data = report.to_json()
    assert data["steps_measured"] == 20 and model.labels_seen > 0
    steps = data["timeline"]
    assert [step["samples"] for step in steps] == [8] * 20
    steps_per_s = len(steps) / sum(step["total_s"] for step in steps)
    assert data["samples_per_s"] == pytest.approx(8 * steps_per_s, rel=1e-6)  # samples, not batches
    # The loader replay counted samples too (it once counted 1 per dict: a headroom of ~1/8 of the truth)
    assert replayed == [8] * 20
    script = data["script"]
    assert script["loader_headroom"] is not None and script["loader_headroom"] > 1  # ~15x here
    assert script["loader_samples_per_s"] > data["samples_per_s"]


def test_loader_rate_counts_the_samples_of_each_dict() -> None:
    class Paced:
        """Dict batches of 8 samples, one every 10 ms: 800 samples/s (100 batches/s)."""

        def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
            for _ in range(8):
                time.sleep(0.01)
                yield {"input_ids": torch.zeros(8, SEQ, dtype=torch.long), "labels": torch.zeros(8)}

    rate = _loader_rate(Paced(), batches=5, warmup=1)
    assert rate is not None and 400 < rate < 900


def test_hf_style_model_gets_the_labels_and_its_own_loss_is_used() -> None:
    model = TinyLM()
    calls = _grads_after(model)
    _forward_backward(model, loader=None)(_batch())
    assert model.labels_seen == 1 and calls == [1]
    assert all(p.grad is None for p in model.parameters())  # zeroed with set_to_none after the step


def test_a_model_without_labels_gets_cross_entropy_of_its_logits() -> None:
    """The batch has `labels` but forward() takes none: they are held back and used for the loss."""
    model = PlainLM()
    calls = _grads_after(model)
    diagnose(DataLoader(TokenDataset(), batch_size=8), model=model, steps=3, warmup=1, replay=False)
    assert calls  # forward + backward ran on every step, no TypeError for an unexpected `labels`


def test_mapping_loss_rule() -> None:
    logits = torch.randn(2, 3, 5)
    labels = torch.tensor([[1, 2, -100], [0, -100, 4]])
    expected = F.cross_entropy(logits.reshape(6, 5), labels.reshape(6), ignore_index=-100)
    torch.testing.assert_close(_mapping_loss(logits, labels), expected)  # flattened; -100 ignored
    torch.testing.assert_close(_mapping_loss({"logits": logits}, labels), expected)  # `logits` key
    torch.testing.assert_close(_mapping_loss(CausalLMOutput(None, logits), labels), expected)  # None loss: logits
    torch.testing.assert_close(_mapping_loss((logits, "cache"), labels), expected)  # first tensor of a tuple
    own = torch.tensor(0.5)
    assert _mapping_loss(CausalLMOutput(own, logits), labels) is own  # the model's own loss first
    assert _mapping_loss({"loss": own, "logits": logits}, None) is own
    assert _mapping_loss((own, logits), labels) is own  # Hugging Face's return_dict=False order
    torch.testing.assert_close(_mapping_loss(logits, None), logits.mean())  # no labels: the mean
    torch.testing.assert_close(_mapping_loss(logits, labels.float()), logits.mean())  # not class indices
    with pytest.raises(TypeError, match="no loss and no tensor"):
        _mapping_loss({"text": "hello"}, labels)


def test_a_dict_batch_without_labels_trains_on_the_mean_of_a_dict_output() -> None:
    class DictOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 4)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"last_hidden_state": self.embed(input_ids) * attention_mask.unsqueeze(-1)}

    model = DictOut()
    calls = _grads_after(model)
    _forward_backward(model, loader=None)(_batch(labels=False))
    assert calls == [1]


def test_a_mapping_that_is_not_a_dict_reaches_the_model_as_keywords() -> None:
    """Hugging Face's BatchEncoding is a UserDict: `move` keeps its type (its `.to()` and attributes keep working)."""
    batch = UserDict(_batch())
    moved = move(batch, torch.device("cpu"))
    assert type(moved) is UserDict and list(moved) == ["input_ids", "attention_mask", "labels"]
    model = TinyLM()
    _forward_backward(model, loader=None)(batch)
    assert model.labels_seen == 1


def test_the_tuple_path_is_unchanged() -> None:
    model = nn.Linear(4, 3)
    calls = _grads_after(model)
    step: Any = _forward_backward(model, loader=None)
    step((torch.randn(5, 4), torch.randint(0, 3, (5,))))
    step([torch.randn(5, 4), torch.randn(5, 3)])  # float targets: the output's mean
    assert calls == [1, 1]
