"""The doctor's behaviour, held by recorded runs: each file under golden/ is what the hooks captured in a real run of
one of the suite's scripts (a window, a whole run, a torchrun job's ranks: records/capture.py's `Capture`, as JSON)
and the report the doctor made of it then. The report is a pure function of the capture (report/report.py's `build`,
and report/job.py's merge for a job), so the same capture must give the same report, to the last figure and word: a
change to the evidence, the verdict, the fixes, their gains or the notes shows here as the first difference.

A deliberate change of behaviour records its cases again: `python tests/unit/diagnose/golden_record.py` (it
rebuilds each file's report from its capture with the code as it is, and says which changed)."""

from __future__ import annotations

import gzip
import json
from typing import Any

import pytest
from golden_record import GOLDEN, report_of

CASES = sorted(p.name.removesuffix(".json.gz") for p in GOLDEN.glob("*.json.gz"))


def differences(recorded: Any, now: Any, path: str = "") -> list[str]:
    """Where two JSON values differ, as paths (the first few)."""
    if isinstance(recorded, dict) and isinstance(now, dict):
        out = [f"{path}.{k}: recorded only" for k in recorded.keys() - now.keys()]
        out += [f"{path}.{k}: new only" for k in now.keys() - recorded.keys()]
        for k in recorded.keys() & now.keys():
            out += differences(recorded[k], now[k], f"{path}.{k}")
        return out
    if isinstance(recorded, list) and isinstance(now, list) and len(recorded) == len(now):
        pairs = enumerate(zip(recorded, now, strict=True))
        return [d for i, (a, b) in pairs for d in differences(a, b, f"{path}[{i}]")]
    return [] if recorded == now else [f"{path}: recorded {recorded!r}, now {now!r}"]


def test_the_recorded_runs_cover_the_doctors_kinds_of_run() -> None:
    kinds = {"window": 0, "whole run": 0, "job": 0}
    for name in CASES:
        with gzip.open(GOLDEN / f"{name}.json.gz", "rt") as f:
            entry = json.load(f)
        kinds["job" if len(entry["captures"]) > 1 else
              "whole run" if entry["captures"][0]["whole"] else "window"] += 1
    assert all(kinds.values()) and len(CASES) >= 30, kinds


@pytest.mark.parametrize("name", CASES)
def test_a_recorded_run_gives_the_report_it_gave(name: str) -> None:
    with gzip.open(GOLDEN / f"{name}.json.gz", "rt") as f:
        entry = json.load(f)
    now = json.loads(json.dumps(report_of(entry["captures"]).to_json()))
    found = differences(entry["report"], now)
    assert not found, f"{name} ({entry['test']}): the report differs from the recorded one at\n  " + "\n  ".join(
        sorted(found)[:20])
