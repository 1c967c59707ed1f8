"""Does following the doctor's top fix pay? The seeds' "before" loop, doctored, then re-run with the fix.

Runs `trainfast doctor` (in-process) on tests/integration/scripts/before_loop.py over the demo dataset's
training images (num_workers=0, full-size JPEG decode, .item() every step), applies the num_workers fix
it prints (workers, threads, persistent workers) and measures again; interleaved, `--repeats` rounds.

    python benchmarks/doctor_fix.py --json doctor_fix.json
"""

from __future__ import annotations

import argparse
import logging
import re
import statistics
from pathlib import Path

from trainfast.atomic import write_json
from trainfast.bench.hardware import describe, hardware
from trainfast.bench.timing import Spread, ratios
from trainfast.data.synthetic import ensure_demo_dataset
from trainfast.diagnose import run_doctor

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "integration" / "scripts" / "before_loop.py"


def doctor(data: Path, *args: str, steps: int) -> dict:
    return run_doctor(str(SCRIPT), args=[str(data), *args], steps=steps, warmup=5).report.to_json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.getLogger("trainfast").setLevel(logging.WARNING)
    data = ensure_demo_dataset("quick") / "train"
    first = doctor(data, steps=args.steps)
    fix = next(r for r in first["recommendations"] if r["id"] == "num_workers")
    workers = re.search(r"num_workers=(\d+)", fix["fix"]).group(1)  # type: ignore[union-attr]
    threads = re.search(r"set_num_threads\((\d+)\)", fix["fix"])
    fixed_args = ["--workers", workers, "--persistent-workers"] + (["--threads", threads.group(1)] if threads else [])
    before, after = [first], []
    for r in range(args.repeats):
        after.append(doctor(data, *fixed_args, steps=args.steps))
        if r + 1 < args.repeats:
            before.append(doctor(data, steps=args.steps))
    rates_before = [b["samples_per_s"] for b in before]
    rates_after = [a["samples_per_s"] for a in after]
    gain = Spread.of(ratios(rates_after, rates_before))
    report = {"verdict_before": first["verdict"], "top_fix": fix, "applied": fixed_args,
              "samples_per_s_before": statistics.median(rates_before),
              "samples_per_s_after": statistics.median(rates_after), "measured_gain": gain.to_json(),
              "expected_gain": fix["expected_gain"],
              "data_wait_before": statistics.median(b["data_wait_fraction"] for b in before),
              "data_wait_after": statistics.median(a["data_wait_fraction"] for a in after),
              "verdict_after": after[-1]["verdict"], "hardware": hardware()}
    print(describe(report["hardware"]))
    print(f"before: {report['verdict_before']}, {report['samples_per_s_before']:.0f} samples/s, "
          f"data wait {report['data_wait_before']:.0%}; doctor's top fix: {fix['title']} "
          f"(expected {fix['expected_gain']:.2f}x)")
    print(f"after {' '.join(fixed_args)}: {report['verdict_after']}, {report['samples_per_s_after']:.0f} samples/s, "
          f"data wait {report['data_wait_after']:.0%}")
    print(f"measured gain {gain.median:.2f}x (median of {args.repeats}, range {gain.minimum:.2f}-{gain.maximum:.2f})")
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
