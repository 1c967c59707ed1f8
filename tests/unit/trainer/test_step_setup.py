"""`prepare_step` and `default_batch_loss`: the step's setup and the default loss, each written once and used by the
Trainer, `tune`, `find_batch_size`, the doctor's `diagnose(loader, model=...)` and the GPU suite."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainfast.trainer.step import default_batch_loss, pair_loss, prepare_step

SRC = Path(__file__).resolve().parents[3] / "src" / "trainfast"


class Keywords(nn.Module):
    """A model called with keyword arguments, Hugging Face style, that computes no loss of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, features: torch.Tensor, mask: torch.Tensor | None = None) -> Any:
        return SimpleNamespace(logits=self.linear(features))


class WithLabels(Keywords):
    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> Any:  # type: ignore[override]
        logits = self.linear(features)
        return {"loss": F.cross_entropy(logits, labels) * 2, "logits": logits}


def test_pairs_take_cross_entropy_for_classes_and_probabilities_and_mse_for_regression() -> None:
    torch.manual_seed(0)
    model, x = nn.Linear(4, 3), torch.randn(5, 4)
    labels = torch.tensor([2, 1, 0, 2, 1])
    assert torch.equal(default_batch_loss(model, (x, labels)), F.cross_entropy(model(x), labels))
    soft = torch.softmax(torch.randn(5, 3), dim=1)
    assert torch.equal(default_batch_loss(model, [x, soft]), F.cross_entropy(model(x), soft))
    regression = nn.Linear(4, 1)
    y = torch.randn(5, 1)
    assert torch.equal(default_batch_loss(regression, (x, y)), F.mse_loss(regression(x), y))
    assert torch.equal(pair_loss(model(x), labels), F.cross_entropy(model(x), labels))


def test_mappings_go_in_as_keywords_and_take_the_model_s_loss_or_the_logits_cross_entropy() -> None:
    torch.manual_seed(0)
    features, labels = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    plain = Keywords()
    loss = default_batch_loss(plain, {"features": features, "labels": labels})  # labels kept out of the call
    assert torch.equal(loss, F.cross_entropy(plain.linear(features), labels, ignore_index=-100))
    assert torch.equal(default_batch_loss(plain, {"features": features}), plain.linear(features).mean())
    own = WithLabels()
    assert torch.equal(default_batch_loss(own, {"features": features, "labels": labels}),
                       F.cross_entropy(own.linear(features), labels) * 2)


@pytest.mark.parametrize(("batch", "shape"), [((torch.zeros(2, 4),) * 3, "tuple of length 3"),
                                              ({"x": torch.zeros(2, 4), "labels": torch.zeros(2)},
                                               "dict with keys ['x', 'labels']"),
                                              (torch.zeros(2, 4), "Tensor")])
def test_other_layouts_are_refused_with_the_fix(batch: Any, shape: str) -> None:
    with pytest.raises(TypeError, match=re.escape(f"got {shape}") + r".*batch_loss"):
        default_batch_loss(nn.Linear(4, 3), batch)


def test_prepare_step_decides_once_and_one_call_is_one_training_step() -> None:
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    step = prepare_step(conv, torch.device("cpu"), lr=0.1, weight_decay=0.0, precision="32-true")
    assert step.channels_last and step.precision.name == "32-true" and not step.scaler.enabled
    assert step.model is conv and isinstance(step.optimizer, torch.optim.AdamW)
    assert conv[0].weight.is_contiguous(memory_format=torch.channels_last)  # moved in the chosen layout
    before = [p.detach().clone() for p in conv.parameters()]
    loss = step((torch.randn(2, 3, 8, 8), torch.tensor([0, 1])), grad_clip=1.0)
    assert loss.dim() == 0 and all(p.grad is None for p in conv.parameters())  # stepped, then freed
    assert all(not torch.equal(a, b) for a, b in zip(before, conv.parameters(), strict=True))
    fp16 = prepare_step(nn.Linear(4, 2), torch.device("cpu"), lr=0.1, weight_decay=0.0, precision="16-mixed",
                        channels_last="auto")
    assert fp16.scaler.enabled and not fp16.channels_last  # no conv: NCHW is moot


def _calls(pattern: str) -> set[str]:
    found = set()
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        if re.search(pattern, text):
            found.add(path.relative_to(SRC).as_posix())
    return found


def test_the_step_setup_and_the_default_loss_exist_once() -> None:
    """A second copy of the setup or of the default loss would let `tune` measure a step the Trainer does not take.
    `bench/naive.py` is the tutorials' plain loop, the "before" of every comparison, written out by design."""
    assert _calls(r"(?<!def )default_optimizer\(") == {"trainer/step.py", "bench/naive.py"}
    assert _calls(r"(?<!def )LossScaler\(") == {"trainer/step.py", "trainer/state.py"}  # state: a resume's switch
    assert _calls(r"\.cross_entropy\(") == {"trainer/step.py", "bench/naive.py"}
    assert _calls(r"(?<!def )resolve_precision\(") <= {"trainer/step.py", "trainer/practice_kinds.py",
                                                      "trainer/state.py", "tune/batch_size.py", "cli/train.py",
                                                      "bench/sweeps.py"}
