"""The doctor's samples/s against each script's own, on loops of every shape (tests/integration/scripts/).

Each script prints its own throughput as it trains (samples over the wall time of its last few steps, or of its
last cycle for the RL loops, rollout included); the doctor runs it unmodified in a fresh process
(`trainfast doctor --json`) and the two are compared: the doctor's figure over the median of the script's lines
after its first (which includes start-up). Also reported: the rollout share against the script's own (RL loops),
the top fix and the basis of its gain, what the candidate trials cost, and the MFU.

    python benchmarks/doctor_truth.py --json doctor_truth.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from trainfast.atomic import write_json
from trainfast.bench.hardware import describe, hardware

SCRIPTS = Path(__file__).resolve().parents[1] / "tests" / "integration" / "scripts"
STEPS, WARMUP = 12, 3
LOOPS: dict[str, list[str]] = {  # script -> its arguments: one thread (a 2-core machine's noise), logs every 3 steps
    "lbfgs_closure.py": ["--print-freq", "3"],
    "rollout_updates.py": [],
    "fabric_rollout.py": [],
    "gan_two_optimizers.py": ["--print-freq", "3"],
    "grad_accum.py": ["--log-steps", "3"],
    "manual_sgd_lm.py": ["--log-interval", "3"],
    "memmap_gpt.py": ["--log-interval", "3"],
}


def run(script: str, args: list[str], workdir: Path) -> dict[str, Any]:
    out = workdir / f"{script}.json"
    extra = ["--data-dir", str(workdir)] if script == "memmap_gpt.py" else []
    done = subprocess.run([sys.executable, "-m", "trainfast", "doctor", "--steps", str(STEPS), "--warmup",
                           str(WARMUP), "--json", str(out), str(SCRIPTS / script), "--", "--threads", "1", *args,
                           *extra], capture_output=True, text=True, timeout=300)
    if done.returncode != 0 or not out.exists():
        return {"script": script, "error": done.stderr[-2000:]}
    report = json.loads(out.read_text())
    own = [float(r) for r in re.findall(r"samples/s\s+([0-9]+(?:\.[0-9]*)?)", done.stdout)][1:]
    own_share = [float(s) / 100 for s in re.findall(r"rollout (\d+)%", done.stdout)][1:]
    top = report["recommendations"][0] if report["recommendations"] else None
    trials = (report["observed"] or {}).get("trials") or {}
    own_rate = statistics.median(own) if own else None
    return {"script": script, "doctor_samples_per_s": report["samples_per_s"], "own_samples_per_s": own_rate,
            "ratio": report["samples_per_s"] / own_rate if own_rate and report["samples_per_s"] else None,
            "collection": (report["fractions"] or {}).get("collection"),
            "own_rollout_share": statistics.median(own_share) if own_share else None,
            "verdict": report["verdict"], "steps_measured": report["steps_measured"],
            "top_fix": None if top is None else {k: top.get(k) for k in ("id", "expected_gain", "gain_basis")},
            "trials_s": trials.get("seconds"), "trials": [(t["id"], t["factor"]) for t in trials.get("trials", [])],
            "mfu": (report.get("compute") or {}).get("mfu")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", nargs="*", default=None, help="scripts to run (default: all)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for script, script_args in LOOPS.items():
            if args.only and script not in args.only:
                continue
            row = run(script, script_args, Path(tmp))
            rows.append(row)
            if "error" in row:
                print(f"{script:24} failed: {row['error'][-300:]}")
                continue
            share = (f" rollout {row['collection'] or 0:.0%} (own {row['own_rollout_share']:.0%})"
                     if row["own_rollout_share"] is not None else "")
            top = row["top_fix"]
            fix = f"{top['id']} {top['expected_gain'] or 0:.2f}x {top['gain_basis']}" if top else "none"
            mfu = f"{row['mfu']:.0%}" if row["mfu"] is not None else "n/a"
            print(f"{script:24} doctor {row['doctor_samples_per_s'] or 0:9,.1f}  "
                  f"own {row['own_samples_per_s'] or 0:9,.1f}  ratio {row['ratio'] or 0:.2f}{share}  "
                  f"top fix: {fix}  trials {row['trials_s'] or 0:.1f} s  MFU {mfu}")
    report = {"rows": rows, "hardware": hardware(), "steps": STEPS, "warmup": WARMUP}
    print(describe(report["hardware"]))
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
