"""A speed practice is one class and one entry in `practice_kinds.PRACTICES`: a toy one, registered here and nowhere
else, is planned, switched cycle by cycle, timed, agreed on and decided by the Trainer's own `Practices`, reported in
fit's result, saved in the checkpoint and kept on resume, through the real loop on CPU with a tiny model.

The toy model sleeps while "napping", so the A/B has a known answer on any CPU."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from trainfast.loader.memory import TensorLoader
from trainfast.trainer import practice_kinds
from trainfast.trainer.config import TrainConfig
from trainfast.trainer.loop import Trainer
from trainfast.trainer.practice import (
    AB,
    FIRST_TIMED,
    MIN_PAIRS,
    Choice,
    Plan,
    Practice,
    Settings,
    decision,
    median_times,
)
from trainfast.trainer.step import LossOf

DELAY_S = 0.05  # a napping step's extra time: far above a busy 2-core CPU's step-to-step noise (15 ms was not)
BASE_S = 0.01  # every step's floor: an awake step of a bare Linear took ~1 ms, stretched several times over by load
STEPS = 30  # per epoch: MIN_RUN_MULTIPLE x MAX_STEPS (an A/B's budget), so the A/B runs


class Napper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 2)
        self.napping = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            time.sleep(BASE_S + DELAY_S * self.napping)
        out: torch.Tensor = self.body(x)
        return out


@dataclass
class NapAB(AB):
    started: list[str] = field(default_factory=list)  # the setting of each cycle `before_cycle` saw start
    started_everywhere: int = 0  # how many, as every rank agreed


class Nap(Practice[NapAB]):
    """Sleep in each step or not: the prior naps; the A/B wakes the model up when that is 3 % faster."""

    name = "nap"

    @staticmethod
    def requested_in(config: TrainConfig) -> str:
        return "auto"  # (a real practice reads its own TrainConfig field)

    def prior(self, settings: Settings) -> str:
        return "napping" if _napper(settings).napping else "awake"

    def plan(self, settings: Settings, plan: Plan) -> NapAB | Choice:
        if plan.affordable:
            return NapAB((self.prior(settings), "awake"))
        return Choice(self.name, self.prior(settings), plan.unmeasured)

    def apply(self, settings: Settings, setting: str) -> None:
        _napper(settings).napping = setting == "napping"

    def before_cycle(self, settings: Settings, ab: NapAB, batch: Any, loss_of: LossOf) -> bool:
        ab.started.append(ab.setting())
        return False

    def figures(self, ab: NapAB) -> list[float]:
        return [float(len(ab.started))]

    def agreed(self, ab: NapAB, values: list[float]) -> NapAB:
        return replace(ab, started_everywhere=int(values[0]))

    def decide(self, settings: Settings, ab: NapAB) -> Choice:
        verdict = decision(ab, "napping", "awake")
        return Choice(self.name, "awake" if verdict.faster else "napping", f"{ab.started_everywhere} cycles",
                      median_times(ab), decision=verdict)


def _napper(settings: Settings) -> Napper:
    assert isinstance(settings.module, Napper)
    return settings.module


def loader() -> TensorLoader:
    g = torch.Generator().manual_seed(0)
    return TensorLoader((torch.randn(STEPS * 4, 4, generator=g), torch.randint(0, 2, (STEPS * 4,), generator=g)), 4,
                        shuffle=False)


def test_a_practice_is_one_class_and_one_registration(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(practice_kinds, "PRACTICES", (*practice_kinds.PRACTICES, Nap))
    config = TrainConfig(epochs=2, progress=False, device="cpu", precision="32-true", checkpoint_dir=str(tmp_path))
    model = Napper()
    first = Trainer(model, config=TrainConfig.from_dict({**config.to_dict(), "epochs": 1}))
    result = first.fit(loader()).to_json()
    nap = result["nap"]
    assert nap["chosen"] == "awake" and nap["measured"] is True, nap["reason"]
    assert nap["step_s"]["napping"] - nap["step_s"]["awake"] > 0.5 * DELAY_S
    assert nap["reason"] == f"{nap['steps']} cycles"  # its hook ran at every cycle's start, its figure agreed
    # 50 ms a step against none: decided at the first look, and fit's result says so
    assert nap["steps"] == FIRST_TIMED + 2 * MIN_PAIRS and nap["decision"]["verdict"] == "faster"
    assert result["ab_steps"]["nap"] == nap["steps"]
    assert model.napping is False  # applied: the rest of the run trains awake
    assert result["compile"]["reason"] == "compile=False"  # the practices before it as they were

    assert torch.load(tmp_path / "last.pt", weights_only=True)["practices"]["nap"] == "awake"
    again = Napper()
    resumed = Trainer(again, config=config).fit(loader(), resume=True).to_json()
    assert resumed["nap"]["chosen"] == "awake" and "kept on resume" in resumed["nap"]["reason"]
    assert again.napping is False and resumed["steps"] == 2 * STEPS
