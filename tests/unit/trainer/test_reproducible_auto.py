""""auto" costs no reproducibility beyond what its A/Bs' timings decide: an A/B ends when its timings decide it, so
the steps it takes in each setting depend on them, and two runs with the same seed whose A/Bs took the same steps
and chose the same end bit-identical, however different their timings were; a run stopped by SIGTERM mid-epoch 2 and
resumed (it takes no A/B: it trains with what its start chose) ends like the uninterrupted one."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from trainfast.loader.make import make_loader
from trainfast.precision import cpufeatures
from trainfast.trainer.config import TrainConfig
from trainfast.trainer.loop import Trainer

BATCHES = 30  # per epoch: the precision and layout A/Bs (at most 10 steps each) both end in epoch 1


class Timed(nn.Module):
    """A conv net with dropout (a random stream the steps use) whose forward sleeps `base_s`, plus `fp32_s` more in
    fp32 and `contiguous_s` more in the contiguous layout: bf16 and channels_last win in every run, by a margin the
    run chooses, each wide enough to be decided at the A/B's first look (2 timed pairs, 6 steps): 3x and more, where
    2 pairs 1.6x apart still decide 2x. The margins and the 10 ms floor are sleeps well above what load adds to a step
    on one intra-op thread (`one_intra_op_thread`; on two, with other processes busy on both cores, these steps varied
    by tens of ms; a step with no floor, ~1 ms, was stretched several times over)."""

    def __init__(self, base_s: float, fp32_s: float, contiguous_s: float) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Dropout(0.2), nn.Flatten(),
                                  nn.Linear(8 * 36, 4))
        self.base_s, self.fp32_s, self.contiguous_s = base_s, fp32_s, contiguous_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            fp32 = not torch.is_autocast_enabled("cpu")
            contiguous = not self.body[0].weight.is_contiguous(memory_format=torch.channels_last)
            time.sleep(self.base_s + self.fp32_s * fp32 + self.contiguous_s * contiguous)
        out: torch.Tensor = self.body(x)
        return out


def run(model: Timed, ckpt: Path | None = None, *, resume: bool = False, stop: object = None,
        made: list[Trainer] | None = None) -> Trainer:
    """One run of 2 epochs; `made`: the Trainer is appended there before it trains (a run stopped by SIGTERM raises)."""
    torch.manual_seed(0)
    model.load_state_dict(Timed(0, 0, 0).state_dict())  # the same initial weights in every run
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(BATCHES * 4, 3, 6, 6, generator=g), torch.randint(0, 4, (BATCHES * 4,), generator=g))
    config = TrainConfig(epochs=2, seed=0, progress=False, device="cpu", log_every=1, compile=False,
                         checkpoint_dir=str(ckpt) if ckpt else None)
    trainer = Trainer(model, config=config, callbacks=[stop] if stop else [])
    if made is not None:
        made.append(trainer)
    trainer.fit(make_loader(data, 4, seed=0), resume=resume)
    return trainer


@pytest.mark.slow
@pytest.mark.usefixtures("one_intra_op_thread")
def test_runs_whose_choices_agree_end_bit_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    stop_at: Callable[[int], object]) -> None:
    monkeypatch.setattr(cpufeatures, "cpu_bf16", lambda: "AVX512-BF16")  # the bf16 prior and its A/B
    wide = run(Timed(base_s=0.01, fp32_s=0.08, contiguous_s=0.08))  # bf16 and channels_last 9x faster
    started: list[Trainer] = []
    with pytest.raises(SystemExit):  # bf16 and channels_last 3x faster; SIGTERM mid-epoch 2
        run(Timed(base_s=0.01, fp32_s=0.02, contiguous_s=0.02), tmp_path, stop=stop_at(BATCHES + 7), made=started)
    narrow = run(Timed(base_s=0.01, fp32_s=0.02, contiguous_s=0.02), tmp_path, resume=True)
    assert wide.practices.saved() == narrow.practices.saved() == {
        "precision": "bf16-mixed", "channels_last": "channels_last", "compile": "eager"}
    # the premise: the same steps in each setting (each A/B decided at its first look), and none on resume
    assert wide.practices.ab_steps() == started[0].practices.ab_steps() == {"precision": 6, "channels_last": 6,
                                                                             "compile": 0}
    assert narrow.practices.ab_steps() == {"precision": 0, "channels_last": 0, "compile": 0}
    assert narrow.step == wide.step == 2 * BATCHES
    for key, value in wide.model.state_dict().items():
        assert torch.equal(value, narrow.model.state_dict()[key]), key
