"""What `trainfast doctor --whole-run` costs a whole training run.

The script is tests/integration/scripts/whole_run_loop.py (an MLP on in-memory tensors through a DataLoader with 2
workers, bf16 autocast, steps of a few milliseconds, an fp32 evaluation pass every 100 steps, a torch.save every 500,
a print at each evaluation), run to its end `--pairs` times plainly (`python script.py`) and under
`trainfast doctor --whole-run`, alternating which goes first. The script times itself from its process's start to
its end (its `truth` line), so both runs are measured by the same clock:
  - `script_overhead`: the script's wall time under the doctor, less the doctor's own work inside it (its scans
    and timed candidate fixes, `doctor_s`, which the report leaves out), over the plain run's: what the hooks and
    the doctor's start-up (importing itself) cost the run;
  - `command_overhead`: the whole command's time over the plain one's: everything the user waits for, the
    doctor's own work and its report after the script included.
Each is the median of the pairs' ratios, with the spread.

    python benchmarks/whole_run_overhead.py --json whole_run_overhead.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trainfast.atomic import write_json
from trainfast.bench.hardware import describe, hardware
from trainfast.bench.timing import Spread

SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "integration" / "scripts" / "whole_run_loop.py"


def truth(stdout: str) -> dict[str, Any]:
    line = next(line for line in stdout.splitlines() if line.startswith("truth "))
    return dict(json.loads(line[len("truth "):]))


def plain(args: list[str]) -> tuple[float, float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=True)
    return time.perf_counter() - started, truth(done.stdout)["wall_s"]


def doctored(args: list[str]) -> tuple[float, float, dict[str, Any]]:
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "trainfast", "doctor", "--whole-run", "--max-seconds", "3600",
                               "--json", str(report), str(SCRIPT), "--", *args], capture_output=True, text=True,
                              check=True)
        command = time.perf_counter() - started
        whole = json.loads(report.read_text())["whole_run"]
    return command, truth(done.stdout)["wall_s"] - whole["doctor_s"], whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=20, help="epochs of 128 steps each (default: 20)")
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args()
    args = ["--epochs", str(opts.epochs), "--samples", "8192", "--batch-size", "64", "--width", "256",
            "--eval-every", "100", "--eval-batches", "8", "--save-every", "500", "--workers", "2"]
    script, command, plain_s, goodput = [], [], [], []
    last: dict[str, Any] = {}
    for pair in range(opts.pairs):
        order = ("plain", "doctor") if pair % 2 == 0 else ("doctor", "plain")
        results: dict[str, Any] = {}
        for which in order:
            results[which] = plain(args) if which == "plain" else doctored(args)
        plain_command, plain_wall = results["plain"]
        doctor_command, doctor_wall, last = results["doctor"]
        script.append(doctor_wall / plain_wall)
        command.append(doctor_command / plain_command)
        plain_s.append(plain_wall)
        goodput.append(last["goodput"])
        print(f"pair {pair + 1}: plain {plain_wall:.2f} s, under --whole-run {doctor_wall:.2f} s "
              f"(+{doctor_wall / plain_wall - 1:.1%}; the doctor's own {last['doctor_s']:.2f} s left out), command "
              f"{plain_command:.2f} -> {doctor_command:.2f} s", flush=True)
    result = {"script": str(SCRIPT.name), "args": args, "pairs": opts.pairs,
              "plain_wall_s": Spread.of(plain_s).__dict__,
              "script_overhead": Spread.of([r - 1 for r in script]).__dict__,
              "command_overhead": Spread.of([r - 1 for r in command]).__dict__,
              "goodput": Spread.of(goodput).__dict__, "steps": last["train"]["steps"],
              "step_ms": 1e3 * last["train"]["seconds"] / max(1, last["train"]["steps"]),
              "hardware": hardware()}
    s, c = result["script_overhead"], result["command_overhead"]
    print(f"{describe(result['hardware'])}: {result['steps']} steps of {result['step_ms']:.1f} ms; script overhead "
          f"{s['median']:+.1%} (IQR {s['low']:+.1%} to {s['high']:+.1%}), command overhead {c['median']:+.1%} "
          f"(IQR {c['low']:+.1%} to {c['high']:+.1%}) over {opts.pairs} interleaved pairs")
    if opts.json:
        write_json(opts.json, result)


if __name__ == "__main__":
    main()
