"""The docs of the doctor's report say what the code does: the fix table in docs/reading-a-report.md is the rules'
own (`fix_table()`, from the registry: what each fix acts on and what `--verify` injects), and every key of the JSON
report (`Report.to_json`) is a row of docs/json-report.md's table.

The keys are those of the recorded reports (tests/unit/diagnose/golden/: windows, whole runs, torchrun jobs, an
out-of-memory crash), of a `--verify` record made with a stand-in child, and of `trainfast env`. A map whose keys are
data (a monitor's metrics, the kinds of collectives) is documented once, with a placeholder: `monitor.series.<metric>`.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import stat
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from trainfast.diagnose.fixes.rule import RULES, fix_table
from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.report.verify import verify_fixes
from trainfast.envcheck.environment import environment

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "unit" / "diagnose" / "golden"
READING = ROOT / "docs" / "reading-a-report.md"
KEYS = ROOT / "docs" / "json-report.md"
TABLE = re.compile(r"<!-- fix table[^>]*-->\n(.*?)<!-- end fix table -->", re.S)
ROW_KEY = re.compile(r"^\|\s*`([^`]+)`\s*\|", re.M)
# maps keyed by data, not by the report's schema: (path, the placeholder the docs write for its keys)
DATA_KEYS = (("monitor.series", "<metric>"), ("monitor.summary", "<metric>"), ("monitor.unavailable", "<source>"),
             ("monitor.gpu_sawtooth", "<metric>"), ("observed.collectives.kinds", "<kind>"),
             ("whole_run.doctor_parts_s", "<what>"), ("verify.gains", "<fix>"))


def key_paths(value: Any, path: str = "") -> set[str]:
    """Every key path of a JSON value: `a.b`, `a[].b` for the items of a list, data keys as their placeholder."""
    found = {path} if path else set()
    if isinstance(value, dict):
        for key, item in value.items():
            placeholder = next((p for prefix, p in DATA_KEYS if path == prefix), None)
            found |= key_paths(item, f"{path}.{placeholder or key}" if path else placeholder or key)
    elif isinstance(value, list):
        for item in value:
            found |= key_paths(item, f"{path}[]")
    return found


FAKE_CHILD = textwrap.dedent("""
    import json, sys
    spec = json.load(open(sys.argv[-1]))
    if spec["overrides"].get("prefetch_factor") == 3:
        print("Traceback: the child fell over", flush=True)
        sys.exit(1)
    workers = spec["overrides"].get("num_workers", 0)
    report = {"samples_per_s": 100.0 * (workers + 1), "verdict": "input-bound", "data_wait_fraction": 0.5,
              "loaders": [{"index": 0, "kind": "DataLoader", "num_workers": workers, "pin_memory": False,
                           "persistent_workers": False, "prefetch_factor": None}]}
    json.dump({"exit_code": 0, "error": None, "report": report}, open(spec["out"], "w"))
""")


def verify_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A `--verify` record (the report's `verify`): a fix measured, one whose run failed; the child a stand-in."""
    child = tmp_path / "child.py"
    child.write_text(FAKE_CHILD)
    launcher = tmp_path / "python"
    launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{child}" "$@"\n')
    launcher.chmod(launcher.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(sys, "executable", str(launcher))
    recs = [Recommendation("num_workers", "t", "w", "f", 1.5, overrides={"num_workers": 2}),
            Recommendation("prefetch_factor", "t", "w", "f", None, overrides={"prefetch_factor": 3})]
    _, info = verify_fixes(str(tmp_path / "train.py"), recommendations=recs, steps=5, warmup=1, max_seconds=5.0)
    return json.loads(json.dumps(info))


def test_the_fix_table_is_the_rules_own() -> None:
    found = TABLE.search(READING.read_text(encoding="utf-8"))
    assert found, f"{READING.relative_to(ROOT)} has no fix table between '<!-- fix table ... -->' and its end mark"
    assert found.group(1) == fix_table(), (
        "the fix table in docs/reading-a-report.md is not the rules' own: paste the output of\n  python -c 'import "
        "trainfast.diagnose; from trainfast.diagnose.fixes.rule import fix_table; print(fix_table(), end=\"\")'")


def test_every_fix_verify_can_inject_injects_what_verify_knows() -> None:
    from trainfast.diagnose.capture.inject import VALID_KEYS

    unknown = {rule.id: set(rule.injects) - set(VALID_KEYS) for rule in RULES if set(rule.injects) - set(VALID_KEYS)}
    assert not unknown, f"rules that would inject what capture/inject.py cannot: {unknown}"


@pytest.mark.skipif(os.name != "posix", reason="a /bin/sh stand-in for --verify's child interpreter")
def test_every_key_of_the_json_report_is_documented(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    found: set[str] = set()
    top: set[str] = set()
    for path in sorted(GOLDEN.glob("*.json.gz")):
        with gzip.open(path, "rt") as f:
            report = json.load(f)["report"]
        found |= key_paths(report)
        top |= set(report)
    found |= key_paths({"verify": verify_record(tmp_path, monkeypatch), "env": environment()})
    documented = set(ROW_KEY.findall(KEYS.read_text(encoding="utf-8")))
    missing = sorted(found - documented)
    assert not missing, f"keys of the JSON report not in docs/json-report.md's table ({len(missing)}):\n  " + \
        "\n  ".join(missing)
    stale = sorted(k for k in documented if "." not in k and "[" not in k and k not in top)
    assert not stale, f"docs/json-report.md documents top-level keys the report does not have: {stale}"
