"""The whole run's ledger (ledger.py) on a real loop in this process: what each hook records, and nothing left
patched."""

from __future__ import annotations

import builtins
import io
import logging
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainfast.diagnose.capture.instrument import Instrumentation
from trainfast.diagnose.capture.ledger import Ledger
from trainfast.diagnose.capture.timeline import Timeline
from trainfast.diagnose.evidence.wholerun import account
from trainfast.diagnose.records.ledger import CHECKPOINT, LOGGING, SLEEP


@pytest.mark.slow
class Classifier(nn.Module):
    """A model class of this test's own: no other test's instrumentation has watched its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(8, 16), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


def test_a_loop_with_evaluation_saves_prints_and_sleeps_is_recorded(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train = DataLoader(TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,))), batch_size=8)
    val = DataLoader(TensorDataset(torch.randn(32, 8), torch.randint(0, 2, (32,))), batch_size=8)
    before = (builtins.print, time.sleep, torch.save, logging.Logger.callHandlers, list(sys.meta_path))
    ledger = Ledger(process_start=time.perf_counter())
    log = logging.getLogger("trainfast.test_ledger")
    with Instrumentation(Timeline(warmup_steps=1, max_steps=3), ledger=ledger):
        for epoch in range(2):
            for x, y in train:
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
            model.eval()
            with torch.no_grad():
                for x, _ in val:
                    model(x)
            model.train()
            torch.save(model.state_dict(), tmp_path / f"epoch{epoch}.pt")
            torch.save(model.state_dict(), io.BytesIO())
            print(f"epoch {epoch}")
            log.warning("epoch %d", epoch)
            time.sleep(0.01)
        writer = threading.Thread(target=torch.save, args=(model.state_dict(), tmp_path / "background.pt"))
        writer.start()
        writer.join()
    end = time.perf_counter()
    assert (builtins.print, time.sleep, torch.save, logging.Logger.callHandlers, sys.meta_path) == before
    assert len(ledger.step_start) == 16 and sum(ledger.step_samples) == 128 and ledger.loader_fed
    assert [p.forwards for p in ledger.passes] == [4, 4] and all(p.end > p.start for p in ledger.passes)
    assert len(ledger.epoch_starts) == 2  # the training loader's; the validation loader's start is its pass's
    writes = ledger.writes
    assert [w.background for w in writes] == [False, False, False, False, True]
    assert writes[0].bytes == (tmp_path / "epoch0.pt").stat().st_size and writes[1].bytes > 0
    kinds = [kind for kind, _, _ in ledger.intervals]
    assert kinds.count(CHECKPOINT) == 4 and kinds.count(SLEEP) == 2 and kinds.count(LOGGING) == 4
    entry = account(ledger, end=end, compiled=False, warmup=1)
    seconds = {p["phase"]: p["seconds"] for p in entry["phases"]}
    assert abs(sum(seconds.values()) - entry["wall_s"]) < 1e-6 * entry["wall_s"] + 1e-9
    assert seconds["evaluation"] > 0 and seconds["checkpoint"] > 0 and entry["other"]["sleep_s"] >= 0.02
    assert entry["evaluation"]["passes"] == 2 and entry["checkpoint"]["count"] == 5
    assert ledger.eval_call is not None and ledger.eval_call[0] is model  # kept for the evaluation trial


def test_a_module_imported_later_is_patched_when_the_script_imports_it() -> None:
    """torch.distributed.checkpoint costs ~0.9 s to import: the ledger patches it when the script imports it (here
    json.tool stands in for it)."""
    ledger = Ledger(process_start=time.perf_counter())
    patched: list[tuple[object, str]] = []
    from trainfast.diagnose.capture import ledger as ledger_module

    finder = ledger_module._OnImport("json.tool", lambda module: patched.append((module, "main")))
    sys.meta_path.insert(0, finder)
    saved = sys.modules.pop("json.tool", None)
    try:
        import json.tool

        imported = json.tool
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        if saved is not None:
            sys.modules["json.tool"] = saved
    assert patched and patched[0][0] is imported and finder not in sys.meta_path
    assert ledger.writes == []
