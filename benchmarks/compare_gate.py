"""`trainfast compare --fail-slower 5` as a CI gate, on real runs: does it pass two runs of the same script, and
fail the same script made 15 % slower?

The script is tests/integration/scripts/whole_run_loop.py (an MLP through a DataLoader with 2 workers, an evaluation
pass and a checkpoint now and then), each run a `trainfast doctor --whole-run --json` report. A first run sets the
sleep per step that makes the run 15 % slower (0.15 x its wall time per sample x the samples of a step); then each of
`--pairs` rounds makes a base report, another of the same script and one with that sleep, and gates both against
the base. Counted: how often the same script passed (exit 0) and how often the slower one failed (exit 1).

    python benchmarks/compare_gate.py --json compare_gate.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from trainfast.atomic import write_json
from trainfast.bench.hardware import describe, hardware

SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "integration" / "scripts" / "whole_run_loop.py"
ARGS = ["--epochs", "4", "--samples", "4096", "--width", "256", "--eval-every", "50", "--eval-batches", "8",
        "--save-every", "100"]


def report(path: Path, sleep_ms: float = 0.0) -> dict[str, Any]:
    """A whole-run report of the script; `sleep_ms` in each step makes it slower with the same arguments."""
    env = os.environ | {"WHOLE_RUN_SLEEP_MS": f"{sleep_ms:.3f}"}
    subprocess.run([sys.executable, "-m", "trainfast", "doctor", "--whole-run", "--json", str(path), str(SCRIPT),
                    "--", *ARGS], capture_output=True, text=True, check=True, env=env)
    return dict(json.loads(path.read_text()))


def gate(base: Path, new: Path, percent: float) -> tuple[int, bool, str]:
    """The gate's exit code, whether it decided (a pass with a "cannot decide" warning also exits 0), its verdict."""
    out = new.with_suffix(".gate.json")
    done = subprocess.run([sys.executable, "-m", "trainfast", "compare", "--fail-slower", f"{percent:g}", "--json",
                           str(out), str(base), str(new)], capture_output=True, text=True)
    verdict = json.loads(out.read_text())["gate"] if out.exists() else {"decided": False, "verdict": done.stderr}
    return done.returncode, bool(verdict["decided"]), str(verdict["verdict"]).strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--slower", type=float, default=0.15, help="how much slower the slow variant is made")
    parser.add_argument("--fail-slower", type=float, default=5.0)
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        first = report(root / "first.json")["whole_run"]
        per_step = first["seconds_per_sample"] * first["train"]["samples"] / first["train"]["steps"]
        sleep_ms = 1e3 * opts.slower * per_step
        print(f"a run: {first['wall_s']:.1f} s, {first['train']['steps']} steps; {sleep_ms:.2f} ms of sleep a step "
              f"makes it {opts.slower:.0%} slower", flush=True)
        rounds = []
        for i in range(opts.pairs):
            base, same, slow = root / f"base{i}.json", root / f"same{i}.json", root / f"slow{i}.json"
            report(base)
            report(same)
            slowed = report(slow, sleep_ms)["whole_run"]
            same_code, same_decided, same_line = gate(base, same, opts.fail_slower)
            slow_code, slow_decided, slow_line = gate(base, slow, opts.fail_slower)
            base_s = json.loads(base.read_text())["whole_run"]["seconds_per_sample"]
            rounds.append({"same_exit": same_code, "slow_exit": slow_code, "same": same_line, "slow": slow_line,
                           "same_decided": same_decided, "slow_decided": slow_decided,
                           "slow_change": slowed["seconds_per_sample"] / base_s - 1})
            print(f"round {i + 1}: same -> exit {same_code} ({same_line}); slower "
                  f"({rounds[-1]['slow_change']:+.1%}) -> exit {slow_code} ({slow_line})", flush=True)
    result = {"pairs": opts.pairs, "fail_slower": opts.fail_slower, "slower": opts.slower, "sleep_ms": sleep_ms,
              "same_passed": sum(r["same_exit"] == 0 for r in rounds),
              "same_undecided": sum(not r["same_decided"] for r in rounds),
              "slow_failed": sum(r["slow_exit"] == 1 for r in rounds),
              "slow_undecided": sum(not r["slow_decided"] for r in rounds), "rounds": rounds, "hardware": hardware()}
    print(f"{describe(result['hardware'])}: the same script passed {result['same_passed']} of {opts.pairs} "
          f"({result['same_undecided']} of them undecided); made {opts.slower:.0%} slower it failed "
          f"{result['slow_failed']} of {opts.pairs} ({result['slow_undecided']} undecided) (--fail-slower "
          f"{opts.fail_slower:g})")
    if opts.json:
        write_json(opts.json, result)


if __name__ == "__main__":
    main()
