"""Adding a fix is one rule object: a `Rule` subclass registered with `@register` is proposed from the evidence, ranked
with the others, written into the report's JSON, shown in the terminal, listed in the docs' fix table and among the
fixes `--verify` can inject, with nothing else edited."""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator

import pytest
from golden_record import GOLDEN, report_of
from rich.console import Console

from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.fixes.rule import RULES, Rule, fix_table, injectable, register, speedup_of_part
from trainfast.diagnose.records.findings import Recommendation


class DropLastBatch(Rule):
    """A toy fix: where the step waits for data at all, drop the epoch's last, short batch (an estimate)."""

    id = "drop_last_toy"
    acts_on = "input"
    summary = "the epoch's last, short batch dropped (a toy rule of this test)"
    injects = ("num_workers",)

    def propose(self, e: Evidence) -> Recommendation | None:
        if e.fractions.data_wait <= 0:
            return None
        return Recommendation(self.id, "Drop the last batch", f"data wait is {e.fractions.data_wait:.0%} of each step",
                              "DataLoader(..., drop_last=True)", speedup_of_part(e.fractions.data_wait, 1.01),
                              overrides={"num_workers": 1}, basis_reason="a toy estimate")


@pytest.fixture
def toy_rule() -> Iterator[None]:
    register(DropLastBatch)
    try:
        yield
    finally:
        RULES[:] = [r for r in RULES if r.id != DropLastBatch.id]


def test_a_registered_rule_goes_from_the_evidence_to_the_screen(toy_rule: None) -> None:
    with gzip.open(GOLDEN / "before_loop.json.gz", "rt") as f:
        entry = json.load(f)
    report = report_of(entry["captures"])
    fixes = report.to_json()["recommendations"]
    toy = next(r for r in fixes if r["id"] == "drop_last_toy")
    assert toy["gain_basis"] == "estimate" and toy["overrides"] == {"num_workers": 1}
    assert [r["id"] for r in fixes].index("drop_last_toy") > [r["id"] for r in fixes].index("num_workers")  # ranked
    out = io.StringIO()
    report.render(Console(file=out, width=160, color_system=None))
    assert "drop_last_toy" in out.getvalue() and "Drop the last batch" in out.getvalue()
    assert "| `drop_last_toy` | input | the epoch's last, short batch dropped" in fix_table()
    assert DropLastBatch.id in [r.id for r in injectable()]


def test_a_fix_is_registered_once() -> None:
    with pytest.raises(ValueError, match="'num_workers' is registered already"):
        register(type("Twice", (Rule,), {"id": "num_workers", "acts_on": "input", "summary": "again"}))
    with pytest.raises(ValueError, match="acts_on='the moon'"):
        register(type("Where", (Rule,), {"id": "moon", "acts_on": "the moon", "summary": "?"}))
