"""torch._dynamo's counters are process-wide: the report's compile figures are this loop's, from snapshots at
instrumentation start, at the end of the warm-up and at the end of the measured steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

from trainfast import diagnose

STEPS, WARMUP = 4, 2


def compile_figures(on_step: Callable[[int], None] = lambda step: None) -> dict[str, Any]:
    """diagnose() of an uncompiled tiny loop; `on_step(i)` runs inside step i (1-based, warm-up included)."""
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,))), batch_size=8)
    calls = [0]

    def step(batch: Any) -> None:
        calls[0] += 1
        on_step(calls[0])
        x, y = batch
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    report = diagnose(loader, step, steps=STEPS, warmup=WARMUP, replay=False)
    observed = report.to_json()["observed"]
    return {"compiled": observed["compiled"], "recompiled": observed["recompiled_frames"],
            "breaks": observed["graph_breaks"],
            # the fix the counters call for (an uncompiled loop found compute-bound, as on a busy machine, gets
            # "compile the model" instead: that is the verdict's, not the counters')
            "compile_fix": any(r.id == "compile" and r.title.startswith("Remove recompilations")
                               for r in report.recommendations)}


@pytest.fixture
def dynamo_counters(monkeypatch: pytest.MonkeyPatch) -> Callable[[int, int], None]:
    """Add frames compiled and graph breaks to torch._dynamo's counters; put them back after the test."""
    monkeypatch.setitem(counters["frames"], "ok", counters["frames"].get("ok", 0))
    monkeypatch.setitem(counters["graph_break"], "test: a break", counters["graph_break"].get("test: a break", 0))

    def add(frames: int, breaks: int) -> None:
        counters["frames"]["ok"] += frames
        counters["graph_break"]["test: a break"] += breaks
    return add


def test_what_the_process_compiled_before_is_not_this_loop(dynamo_counters: Callable[[int, int], None]) -> None:
    """An earlier diagnose() or another model compiled 3 frames with 2 breaks before this eager loop ran."""
    dynamo_counters(3, 2)
    assert compile_figures() == {"compiled": False, "recompiled": 0, "breaks": 0, "compile_fix": False}


def test_compiling_in_the_warm_up_is_compiled_but_no_recompile(dynamo_counters: Callable[[int, int], None]) -> None:
    """A graph break found while compiling in the warm-up still costs eager time at every step: it counts."""
    dynamo_counters(3, 2)
    figures = compile_figures(lambda step: dynamo_counters(1, 1) if step == 1 else None)
    assert figures["compiled"] and figures["recompiled"] == 0 and figures["breaks"] == 1 and figures["compile_fix"]


def test_recompiles_in_the_measured_steps_are_counted(dynamo_counters: Callable[[int, int], None]) -> None:
    dynamo_counters(3, 2)
    figures = compile_figures(lambda step: dynamo_counters(1, 0 if step == 1 else 1) if step in (1, 4) else None)
    assert figures["compiled"] and figures["recompiled"] == 1 and figures["breaks"] == 1 and figures["compile_fix"]
