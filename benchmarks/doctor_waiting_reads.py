"""The doctor on a plain DataLoader whose every read waits on storage, with its top fix measured by `--verify`.

The script is tests/integration/scripts/waiting_reads.py: each `__getitem__` sleeps `--latency-ms` (default 20 ms,
an object store's first-byte latency) before a little CPU work, 32 samples a batch, `--workers` (default 2)
DataLoader workers, a small conv net on the CPU. Each run is `trainfast doctor --verify --json` in a fresh
process; reported: what the doctor says the workers do (busy share, the time a batch takes inside a worker), its
top fix with the expected gain, and the gain `--verify` measured (the script re-run with the fix, between two
unchanged runs).

    python benchmarks/doctor_waiting_reads.py --runs 3 --json doctor_waiting_reads.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from trainfast.atomic import write_json
from trainfast.bench.hardware import describe, hardware

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "integration" / "scripts" / "waiting_reads.py"


def one_run(workers: int, latency_ms: float, samples: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "trainfast", "doctor", "--verify", "--json", str(report_path), str(SCRIPT),
                   "--", "--workers", str(workers), "--latency-ms", str(latency_ms), "--samples", str(samples)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not report_path.exists():
            raise SystemExit(f"doctor failed ({done.returncode}):\n{done.stderr[-2000:]}")
        report = json.loads(report_path.read_text())
    top = report["recommendations"][0] if report["recommendations"] else {}
    return {"verdict": report["verdict"], "verdict_reason": report["verdict_reason"],
            "samples_per_s": report["samples_per_s"], "workers": report["observed"]["workers"],
            "top_fix": top.get("title"), "overrides": top.get("overrides"), "expected_gain": top.get("expected_gain"),
            "gain_basis": top.get("gain_basis"), "verified_gain": top.get("measured_gain"),
            "fixes": [r["id"] for r in report["recommendations"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    machine = hardware()
    print(describe(machine))
    runs = []
    for i in range(args.runs):
        run = one_run(args.workers, args.latency_ms, args.samples)
        runs.append(run)
        w = run["workers"] or {}
        print(f"run {i + 1}: {run['verdict']}, workers busy {w.get('busy', float('nan')):.0%}, a batch "
              f"{(w.get('batch_s') or float('nan')) * 1e3:.0f} ms inside a worker; top fix: {run['top_fix']} "
              f"expected {run['expected_gain']}x ({run['gain_basis']}), verified {run['verified_gain']}x; "
              f"fixes {run['fixes']}")
    verified = [r["verified_gain"] for r in runs if r["verified_gain"] is not None]
    if verified:
        print(f"verified gain of the top fix: median {statistics.median(verified):.1f}x "
              f"(range {min(verified):.1f}-{max(verified):.1f}x over {len(verified)} run(s))")
    if args.json:
        write_json(args.json, {"hardware": machine, "args": vars(args) | {"json": str(args.json)}, "runs": runs})


if __name__ == "__main__":
    main()
