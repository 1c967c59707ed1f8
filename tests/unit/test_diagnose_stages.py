"""The doctor is laid out as the stages a report passes through, and each stage imports only the records and the
stages before it: records -> capture -> evidence -> verdict -> fixes -> report -> show, then `run.py`, which wires
them, and the package's face (`trainfast/diagnose/__init__.py`). `compare/` stands apart: it reads reports as JSON
and imports no stage. Imports inside functions and under TYPE_CHECKING count (the import graph of
tests/unit/test_import_cycles.py). And no module of the doctor is over `MAX_LINES` lines."""

from __future__ import annotations

from pathlib import Path

from test_import_cycles import Edges, _package_root, import_graph

PACKAGE = "trainfast.diagnose"
STAGES = ("records", "capture", "evidence", "verdict", "fixes", "report", "show", "run")
APART = "compare"
MAX_LINES = 400


def stage_of(module: str) -> str | None:
    """The stage of a module of the doctor ("face" for the package itself, "compare" for compare/), None outside."""
    if module == PACKAGE:
        return "face"
    if not module.startswith(PACKAGE + "."):
        return None
    return module[len(PACKAGE) + 1:].split(".")[0]


def backward_imports(graph: Edges) -> list[str]:
    """Every import of the doctor's modules that reaches a later stage, the face, compare from a stage (or a stage
    from compare), or a module that is in no stage, as "module (stage) -> target (stage) at path:line"."""
    problems = []
    for module, targets in sorted(graph.items()):
        stage = stage_of(module)
        if stage is None or stage == "face":
            continue
        for target, where in sorted(targets.items()):
            other = stage_of(target)
            if other is None:
                continue
            if stage == APART or other == APART:
                ok = stage == other
            else:
                ok = stage in STAGES and other in STAGES and STAGES.index(other) <= STAGES.index(stage)
            if not ok:
                problems.append(f"{module} ({stage}) -> {target} ({other}) at {', '.join(where)}")
    return problems


def test_each_stage_imports_only_the_records_and_the_stages_before_it() -> None:
    graph = import_graph()
    stages = {stage_of(m) for m in graph} - {None, "face"}
    assert stages <= {*STAGES, APART}, f"modules of the doctor outside every stage: {stages - {*STAGES, APART}}"
    problems = backward_imports(graph)
    assert not problems, ("a stage of the doctor imports a later one (order: " + " -> ".join(STAGES) + "):\n  "
                          + "\n  ".join(problems))


def test_the_check_fails_when_a_stage_imports_a_later_one() -> None:
    graph: Edges = {
        "trainfast.diagnose.capture.timeline": {"trainfast.diagnose.records.steps": ["a:1"]},
        "trainfast.diagnose.evidence.evidence": {"trainfast.diagnose.fixes.rule": ["evidence.py:9"]},
        "trainfast.diagnose.report.report": {"trainfast.diagnose.show.terminal": ["report.py:14"]},
        "trainfast.diagnose.compare.gate": {"trainfast.diagnose.records.steps": ["gate.py:3"]},
        "trainfast.diagnose.show.terminal": {"trainfast.diagnose.report.report": ["terminal.py:5"],
                                             "trainfast.loader.make": ["terminal.py:6"]},
    }
    assert backward_imports(graph) == [
        "trainfast.diagnose.compare.gate (compare) -> trainfast.diagnose.records.steps (records) at gate.py:3",
        "trainfast.diagnose.evidence.evidence (evidence) -> trainfast.diagnose.fixes.rule (fixes) at evidence.py:9",
        "trainfast.diagnose.report.report (report) -> trainfast.diagnose.show.terminal (show) at report.py:14",
    ]


def test_no_module_of_the_doctor_is_over_400_lines() -> None:
    root = _package_root() / "diagnose"
    long = {str(p.relative_to(root.parent)): n for p in sorted(root.rglob("*.py"))
            if (n := len(Path(p).read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules of the doctor over {MAX_LINES} lines (split them by what they do): {long}"
