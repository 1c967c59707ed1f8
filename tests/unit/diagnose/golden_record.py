"""The recorded runs under golden/ (test_golden_reports.py): how a report is made from a file's captures, and, run
as a script, the files' reports made again with the code as it is, for a deliberate change of behaviour:

    .venv/bin/python tests/unit/diagnose/golden_record.py          # says which reports would change
    .venv/bin/python tests/unit/diagnose/golden_record.py --write  # and records them
"""

from __future__ import annotations

import argparse
import gzip
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from trainfast.diagnose.records.capture import Capture
from trainfast.diagnose.report.job import merge, rank_summary
from trainfast.diagnose.report.report import Report, build

GOLDEN = Path(__file__).resolve().parent / "golden"


def report_of(captures: list[dict[str, Any]]) -> Report:
    """The report of one run (one capture), or of a torchrun job (one capture per rank, rank 0's first): each rank's
    report sent as its summary and merged into rank 0's, on rank 0's host, as report/job.py does."""
    records = [Capture.from_json(c) for c in captures]
    reports = [build(c) for c in records]
    if len(reports) == 1:
        return reports[0]
    world = len(reports)
    summaries = {rank: rank_summary(replace(report, world_size=world, rank=rank), rank=rank,
                                    exit_code=int((capture.script or {}).get("exit_code") or 0),
                                    host=capture.machine.host)
                 for rank, (capture, report) in enumerate(zip(records, reports, strict=True))}
    return merge(replace(reports[0], world_size=world, rank=0), summaries, world_size=world,
                 host=records[0].machine.host)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="record the reports made now")
    args = parser.parse_args()
    for path in sorted(GOLDEN.glob("*.json.gz")):
        with gzip.open(path, "rt") as f:
            entry = json.load(f)
        now = json.loads(json.dumps(report_of(entry["captures"]).to_json()))
        if now == entry["report"]:
            continue
        print(f"{path.name}: the report changed")
        if args.write:
            with gzip.open(path, "wt") as f:
                json.dump(entry | {"report": now}, f)


if __name__ == "__main__":
    main()
