"""The docs name only what exists: source paths, dotted module names, `make` targets, benchmark scripts, and the
floors of ARCHITECTURE.md match the imports.

Each failure names the doc, the name as written, and what is missing. Modules are found as files; a dotted name
`trainfast.mod.attr` is accepted when `trainfast/mod.py` (or `mod/__init__.py`) exists and, imported, has `attr`.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PKG = SRC / "trainfast"
STRUCTURE_DOCS = ("ARCHITECTURE.md", "CONTRIBUTING.md")  # dotted names and source paths are checked here
MAKE_DOCS = ("README.md", "ARCHITECTURE.md", "CONTRIBUTING.md")
BENCHMARK_DOCS = (*MAKE_DOCS, "BENCHMARKS.md")

SRC_PATH = re.compile(r"src/trainfast/[\w/]+\.py")
TESTS_PATH = re.compile(r"(?<![\w/.])tests/[\w/]+\.py")
DOTTED = re.compile(r"(?<![\w.])trainfast(?:\.[A-Za-z_]\w*)+")
BENCHMARK = re.compile(r"(?<![\w/.])benchmarks/([\w.-]*\w)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
MAKE = re.compile(r"(?<![\w-])make[ \t]+([A-Za-z][\w.-]*)")
MAKE_RULE = re.compile(r"^([A-Za-z][\w.-]*(?:[ \t]+[A-Za-z][\w.-]*)*)[ \t]*:(?!=)", re.M)


def _read(doc: str) -> str:
    path = ROOT / doc
    if not path.exists():
        pytest.fail(f"{doc} is missing from the repository root")
    return path.read_text(encoding="utf-8")


def _subpackages() -> list[str]:
    return sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").is_file())


def _short_path() -> re.Pattern[str]:
    """`trainer/step.py` and the like: a path in one of trainfast's subpackages, written without `src/trainfast/`."""
    return re.compile(rf"(?<![\w/.])(?:{'|'.join(map(re.escape, _subpackages()))})/[\w/]+\.py")


def _module_file(parts: list[str]) -> Path | None:
    """The file of module `trainfast.<parts>`, or None."""
    base = PKG.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _dotted_problem(name: str) -> str | None:
    """Why `name` (`trainfast.pkg.mod` or `trainfast.pkg.mod.attr...`) does not resolve, or None when it does."""
    parts = name.split(".")[1:]
    cut = len(parts)
    while cut > 0 and _module_file(parts[:cut]) is None:  # the longest prefix that is a module file
        cut -= 1
    obj: object = importlib.import_module(".".join(["trainfast", *parts[:cut]]))
    for i in range(cut, len(parts)):
        if hasattr(obj, parts[i]):
            obj = getattr(obj, parts[i])
            continue
        owner = ".".join(["trainfast", *parts[:i]])
        package = cut == 0 or _module_file(parts[:cut]) == PKG.joinpath(*parts[:cut], "__init__.py")
        if i == cut and package:  # a name in a package: most likely a module that is not there
            missing = PKG.joinpath(*parts[: i + 1]).relative_to(ROOT)
            return f"no module {missing}.py, no package {missing}/, and {owner} has no attribute {parts[i]!r}"
        return f"{owner} has no attribute {parts[i]!r}"
    return None


def _code(text: str) -> str:
    """The doc's code: fenced blocks and inline spans (prose such as "make the next epoch" is not a command)."""
    return "\n".join([*FENCE.findall(text), *INLINE.findall(FENCE.sub("", text))])


def _make_targets() -> set[str]:
    return {t for rule in MAKE_RULE.findall((ROOT / "Makefile").read_text()) for t in rule.split()}


def test_source_paths_in_the_docs_exist() -> None:
    short = _short_path()
    missing = []
    for doc in STRUCTURE_DOCS:
        text = _read(doc)
        for path in sorted(set(SRC_PATH.findall(text)) | set(TESTS_PATH.findall(text))):
            if not (ROOT / path).is_file():
                missing.append(f"{doc}: {path} does not exist")
        for path in sorted(set(short.findall(text))):
            if not (PKG / path).is_file():
                missing.append(f"{doc}: {path} does not exist (as src/trainfast/{path})")
    assert not missing, "paths named in the docs that are not in the repository:\n  " + "\n  ".join(missing)


def test_dotted_module_names_in_the_docs_resolve() -> None:
    problems = []
    for doc in STRUCTURE_DOCS:
        for name in sorted(set(DOTTED.findall(_read(doc)))):
            try:
                why = _dotted_problem(name)
            except Exception as e:  # an import that fails is a finding too, not a crash of the test
                why = f"importing it failed: {type(e).__name__}: {e}"
            if why is not None:
                problems.append(f"{doc}: {name}: {why}")
    assert not problems, "module names in the docs that do not resolve:\n  " + "\n  ".join(problems)


def test_make_targets_in_the_docs_exist() -> None:
    targets = _make_targets()
    missing = [f"{doc}: `make {target}` is not a target in the Makefile (targets: {', '.join(sorted(targets))})"
               for doc in MAKE_DOCS for target in sorted(set(MAKE.findall(_code(_read(doc)))))
               if target not in targets]
    assert not missing, "\n".join(missing)


def test_benchmark_files_in_the_docs_exist() -> None:
    missing = [f"{doc}: benchmarks/{name} does not exist"
               for doc in BENCHMARK_DOCS for name in sorted(set(BENCHMARK.findall(_read(doc))))
               if not (ROOT / "benchmarks" / name).exists()]
    assert not missing, "benchmark files named in the docs that are not in benchmarks/:\n  " + "\n  ".join(missing)


# --- the floors of ARCHITECTURE.md ---------------------------------------------------------------------------


def _floors() -> dict[str, int]:
    """ARCHITECTURE.md's floors table: each entry (`units.py`, `loader/`, `__init__.py`) -> its floor."""
    text = _read("ARCHITECTURE.md")
    section = re.search(r"^## \d+\. The floors$(.*?)(?=^## )", text, re.M | re.S)
    assert section, "ARCHITECTURE.md has no '## 1. The floors' section"
    floors: dict[str, int] = {}
    for row in re.findall(r"^\|\s*(\d+)\s*\|([^|]*)\|", section.group(1), re.M):
        for entry in INLINE.findall(row[1]):
            assert entry not in floors, f"ARCHITECTURE.md floors: {entry} is on two floors"
            floors[entry] = int(row[0])
    assert floors, "ARCHITECTURE.md's floors section has no table rows '| <floor> | `module.py` `pkg/` ... | ... |'"
    return floors


def _entry(parts: list[str], top_level: set[str]) -> str:
    """The floors-table entry of module `trainfast.<parts>` (`[]`: the package itself; a name that is no module of
    its own, as in `from trainfast import make_loader`, comes from `__init__.py`)."""
    head = parts[0] if parts else ""
    for entry in (f"{head}/", f"{head}.py"):
        if head and entry in top_level:
            return entry
    return "__init__.py"


def _imports(path: Path) -> list[tuple[list[str], int]]:
    """The trainfast modules `path` imports anywhere in it (functions and `TYPE_CHECKING` blocks too), each as its
    name parts after `trainfast`, with the line."""
    package = list(path.relative_to(PKG).parts[:-1])  # for relative imports
    found: list[tuple[list[str], int]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name.split(".")[1:], node.lineno) for a in node.names if a.name.split(".")[0] == "trainfast"]
        elif isinstance(node, ast.ImportFrom):
            module = node.module.split(".") if node.module else []
            if node.level:
                base = package[: len(package) - (node.level - 1)] + module
            elif module and module[0] == "trainfast":
                base = module[1:]
            else:
                continue
            found += [(base or [a.name], node.lineno) for a in node.names]  # `from trainfast import atomic`
    return found


def test_the_floors_table_matches_the_imports() -> None:
    floors = _floors()
    top_level = {p.name + "/" for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    top_level |= {p.name for p in PKG.glob("*.py")}
    problems = [f"{entry} is on floor {floors[entry]} but src/trainfast/{entry} does not exist"
                for entry in sorted(set(floors) - top_level)]
    problems += [f"src/trainfast/{entry} is on no floor: add it to the table"
                 for entry in sorted(top_level - set(floors))]
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        source = _entry([] if rel == Path("__init__.py") else [rel.parts[0].removesuffix(".py")], top_level)
        if source not in floors:
            continue
        upward = {(line, target) for parts, line in _imports(path)
                  if (target := _entry(parts, top_level)) != source and floors.get(target, -1) >= floors[source]}
        for line, target in sorted(upward):
            problems.append(f"{source} (floor {floors[source]}) imports {target} (floor {floors[target]}) at "
                            f"src/trainfast/{rel}:{line}: imports go down only; move the code or the table's row")
    assert not problems, "ARCHITECTURE.md's floors do not match the code:\n  " + "\n  ".join(problems)


def test_the_checks_find_what_they_look_for() -> None:
    assert _dotted_problem("trainfast.trainer.step.forward_backward") is None
    assert _dotted_problem("trainfast.no_such_module") == (
        "no module src/trainfast/no_such_module.py, no package src/trainfast/no_such_module/, and trainfast has no "
        "attribute 'no_such_module'")
    assert _dotted_problem("trainfast.trainer.step.nothing") == "trainfast.trainer.step has no attribute 'nothing'"
    doc = "workers make the next epoch's batches\n```bash\nmake demo  # makes .venv\n```\nthen `make test-fast`.\n"
    assert MAKE.findall(_code(doc)) == ["demo", "test-fast"]
    assert {"install", "test", "test-fast", "lint"} <= _make_targets()
