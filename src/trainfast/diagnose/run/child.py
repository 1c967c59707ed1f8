"""`python -m trainfast.diagnose.run.child SPEC.json`: one of `--verify`'s runs of the script (report/verify.py), a
doctor run with the spec's fix injected (capture/inject.py), its report written to the spec's `out` as JSON, with
the script's own loss per step beside it (`loss`: records/losses.py `LossTrace`, what verify compares)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from trainfast.atomic import write_json
from trainfast.diagnose.capture.inject import apply_overrides
from trainfast.diagnose.run.doctor import run_doctor


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m trainfast.diagnose.run.child SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    with apply_overrides(spec.get("overrides") or {}) as injected:
        run = run_doctor(spec["target"], module=bool(spec.get("module")), args=list(spec.get("args") or []),
                         steps=int(spec["steps"]), warmup=int(spec["warmup"]), max_seconds=spec.get("max_seconds"),
                         whole_run=bool(spec.get("whole_run")),
                         probe_gains=False)  # the fix itself is what this run measures
    write_json(spec["out"], {"exit_code": run.exit_code, "error": run.error, "report": run.report.to_json(),
                             "loss": run.loss.to_json() if run.loss is not None else None,
                             "injected": {"events": injected.events, "model": injected.model,
                                          "fell_back": injected.fell_back}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
