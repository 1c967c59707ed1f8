"""`trainfast doctor --patch FILE`: the report's loader fixes made permanent in the script's own source, as a
unified diff (show/patch.py writes it with libcst; `git apply FILE` takes it).

Which fixes: with `--verify`, those decided faster that train the same (what `trainfast run --apply` applies:
run/apply.py `verified_fixes`); without, every loader fix the report proposes, said to be unverified. A fix is
patched where the doctor saw the script's own `DataLoader(...)` call (`where`, fixes/where.py); its DataLoader
keywords only: an override that is not one (the intra-op threads a worker fix comes with) is named for the user to
set."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainfast.decide import FASTER
from trainfast.diagnose.capture.inject import LOADER_KEYS
from trainfast.diagnose.run.apply import verified_fixes
from trainfast.diagnose.show.patch import KeywordEdit, KeywordPatch, keyword_patch


def report_patch(report: Mapping[str, Any], *, root: Path) -> tuple[KeywordPatch, list[str]]:
    """The diff for `report` (a doctor report's JSON), paths relative to `root`, and the notes on what it leaves to
    the user (a fix with no DataLoader call of the script's own, a setting that is not a keyword)."""
    verified = report.get("verify") is not None
    kept = {fix.id for fix in verified_fixes(report)} if verified else set()
    edits: list[KeywordEdit] = []
    notes: list[str] = []
    for fix in report.get("recommendations") or []:
        overrides = fix.get("overrides") or {}
        keywords = {k: v for k, v in overrides.items() if k in LOADER_KEYS}
        if not keywords:
            continue
        if verified and fix["id"] not in kept:
            continue
        where = fix.get("where") or {}
        if where.get("what") != "loader" or not where.get("file"):
            setting = f": {where['setting']}" if where.get("setting") else ""
            notes.append(f"{fix['id']}: no DataLoader call in the script's own code was seen{setting}")
            continue
        edits.append(KeywordEdit(fix["id"], where["file"], int(where["line"]), "DataLoader", keywords))
        if overrides.get("threads") is not None:
            notes.append(f"{fix['id']}: also torch.set_num_threads({overrides['threads']}) at the script's start "
                         "(not a DataLoader argument: not in the patch)")
    if not verified and edits:
        notes.append(f"not verified: these are the doctor's proposals; --verify keeps only the fixes it decides "
                     f"faster (by {FASTER:g}x, beyond the runs' noise) that train the same")
    return keyword_patch(edits, root=root), notes
