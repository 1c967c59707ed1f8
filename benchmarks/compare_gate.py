"""`trainfast compare --fail-slower 5` as a CI gate, on real runs: does it pass runs of the same script, and fail the
same script made 15 % slower?

The script is tests/integration/scripts/whole_run_loop.py (an MLP through a DataLoader with 2 workers, an evaluation
pass and a checkpoint now and then), each run a `trainfast doctor --whole-run --json` report. A first run sets the
sleep per step that makes the run 15 % slower (0.15 x its wall time per sample x the samples of a step); then each of
`--pairs` rounds makes `--reports` base reports, as many of the same script and as many with that sleep, in turn
(base, same, slower, base, ...: a drift of the machine falls on all three), and gates both sides against the base
ones (`trainfast compare --fail-slower 5 'base-*.json' 'same-*.json'`). Counted: how often the same script passed
(exit 0) and how often the slower one failed (exit 1). `--reports 1` is the one-report-a-side gate.

    python benchmarks/compare_gate.py --reports 3 --json compare_gate.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from trainfast.atomic import write_json
from trainfast.bench.hardware import describe, hardware

SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "integration" / "scripts" / "whole_run_loop.py"
ARGS = ["--samples", "4096", "--width", "256", "--eval-every", "50", "--eval-batches", "8", "--save-every", "100"]


EPOCHS = ["--epochs", "4"]  # set from --epochs


def report(path: Path, sleep_ms: float = 0.0) -> dict[str, Any]:
    """A whole-run report of the script; `sleep_ms` in each step makes it slower with the same arguments."""
    env = os.environ | {"WHOLE_RUN_SLEEP_MS": f"{sleep_ms:.3f}"}
    subprocess.run([sys.executable, "-m", "trainfast", "doctor", "--whole-run", "--json", str(path), str(SCRIPT),
                    "--", *EPOCHS, *ARGS], capture_output=True, text=True, check=True, env=env)
    return dict(json.loads(path.read_text()))


def gate(base: list[Path], new: list[Path], percent: float) -> tuple[int, bool, str]:
    """The gate's exit code, whether it decided (a pass with a "cannot decide" warning also exits 0), its verdict."""
    out = new[0].with_suffix(".gate.json")
    patterns = [str(p[0]) if len(p) == 1 else str(p[0].parent / p[0].name.replace("-1.json", "-*.json"))
                for p in (base, new)]
    done = subprocess.run([sys.executable, "-m", "trainfast", "compare", "--fail-slower", f"{percent:g}", "--json",
                           str(out), *patterns], capture_output=True, text=True)
    verdict = json.loads(out.read_text())["gate"] if out.exists() else {"decided": False, "verdict": done.stderr}
    return done.returncode, bool(verdict["decided"]), str(verdict["verdict"]).strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--reports", type=int, default=3, help="reports a side (1: one run against one)")
    parser.add_argument("--epochs", type=int, default=4, help="the script's epochs of 64 steps (4: 3.6 s runs here, "
                                                              "half of them start-up)")
    parser.add_argument("--slower", type=float, default=0.15, help="how much slower the slow variant is made")
    parser.add_argument("--fail-slower", type=float, default=5.0)
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args()
    EPOCHS[1] = str(opts.epochs)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        first = report(root / "first.json")["whole_run"]
        per_step = first["seconds_per_sample"] * first["train"]["samples"] / first["train"]["steps"]
        sleep_ms = 1e3 * opts.slower * per_step
        print(f"a run: {first['wall_s']:.1f} s, {first['train']['steps']} steps; {sleep_ms:.2f} ms of sleep a step "
              f"makes it {opts.slower:.0%} slower; {opts.reports} report(s) a side", flush=True)
        rounds = []
        for i in range(opts.pairs):
            folder_i = root / f"round{i}"
            folder_i.mkdir()
            sides: dict[str, list[Path]] = {"base": [], "same": [], "slow": []}
            for k in range(1, opts.reports + 1):
                for side in sides:
                    path = folder_i / f"{side}-{k}.json"
                    report(path, sleep_ms if side == "slow" else 0.0)
                    sides[side].append(path)
            same_code, same_decided, same_line = gate(sides["base"], sides["same"], opts.fail_slower)
            slow_code, slow_decided, slow_line = gate(sides["base"], sides["slow"], opts.fail_slower)
            per_sample = {side: statistics.fmean(json.loads(p.read_text())["whole_run"]["seconds_per_sample"]
                                                 for p in paths) for side, paths in sides.items()}
            rounds.append({"same_exit": same_code, "slow_exit": slow_code, "same": same_line, "slow": slow_line,
                           "same_decided": same_decided, "slow_decided": slow_decided,
                           "same_change": per_sample["same"] / per_sample["base"] - 1,
                           "slow_change": per_sample["slow"] / per_sample["base"] - 1})
            print(f"round {i + 1}: same ({rounds[-1]['same_change']:+.1%}) -> exit {same_code} ({same_line}); slower "
                  f"({rounds[-1]['slow_change']:+.1%}) -> exit {slow_code} ({slow_line})", flush=True)
    result = {"pairs": opts.pairs, "reports": opts.reports, "epochs": opts.epochs, "fail_slower": opts.fail_slower,
              "slower": opts.slower,
              "sleep_ms": sleep_ms, "same_passed": sum(r["same_exit"] == 0 for r in rounds),
              "same_undecided": sum(not r["same_decided"] for r in rounds),
              "slow_failed": sum(r["slow_exit"] == 1 for r in rounds),
              "slow_undecided": sum(not r["slow_decided"] for r in rounds), "rounds": rounds, "hardware": hardware()}
    print(f"{describe(result['hardware'])}: {opts.reports} report(s) a side: the same script passed "
          f"{result['same_passed']} of {opts.pairs} ({result['same_undecided']} of them undecided); made "
          f"{opts.slower:.0%} slower it failed {result['slow_failed']} of {opts.pairs} ({result['slow_undecided']} "
          f"undecided) (--fail-slower {opts.fail_slower:g})")
    if opts.json:
        write_json(opts.json, result)


if __name__ == "__main__":
    main()
