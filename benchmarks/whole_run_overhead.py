"""What `trainfast doctor --whole-run` costs a whole training run.

The script is tests/integration/scripts/whole_run_loop.py (an MLP on in-memory tensors through a DataLoader, bf16
autocast, steps of a few milliseconds, an fp32 evaluation pass every 100 steps, a torch.save every 500, a print at
each evaluation), run to its end `--pairs` times plainly (`python script.py`) and under `trainfast doctor
--whole-run`, alternating which goes first. One intra-op thread and no loader workers in both: on 2 cores, workers
and threads that share them made the same plain run take 11.7 to 18.6 s (five runs), a spread that hides a cost of
a few percent. The script times itself from its process's start to
its end (its `truth` line), so both runs are measured by the same clock:
  - `script_overhead`: the script's wall time under the doctor, less the doctor's own work inside it (`doctor_s`,
    which the report leaves out: importing itself, its scans and timed candidate fixes), over the plain run's: what
    the hooks cost the run;
  - `after_startup_overhead`: the same from the first training batch on (the script's wall less its start-up, as
    it timed both): the hooks' cost on the run itself, without the doctor's fixed cost of importing itself;
  - `command_overhead`: the whole command's time over the plain one's: everything the user waits for, the
    doctor's own work and its report after the script included.
Each is the median of the pairs' ratios, with the spread. On this shared 2-core VM the same plain run takes 13 to
19 s from one minute to the next, so these spreads are wider than the cost; the per-step part measures it directly:
  - `per_step`: the same step (the script's MLP, bf16 autocast, AdamW, batch 64 from a DataLoader, one thread) in
    this process, plain, under the window doctor's hooks, under a whole run's (the ledger too) and with the
    doctor's monitor thread sampling beside them, 128 steps per run after 40 of warm-up; and the script's
    evaluation pass with its print and save, plain and under the whole run's hooks; `--rounds` rounds in turn:
    the fastest and the median run of each, and each part's cost over the plain one.

    python benchmarks/whole_run_overhead.py --json whole_run_overhead.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainfast.atomic import write_json
from trainfast.bench.hardware import describe, hardware
from trainfast.bench.timing import Spread

SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "integration" / "scripts" / "whole_run_loop.py"


def truth(stdout: str) -> dict[str, Any]:
    line = next(line for line in stdout.splitlines() if line.startswith("truth "))
    return dict(json.loads(line[len("truth "):]))


ENV = os.environ | {"OMP_NUM_THREADS": "1"}


def plain(args: list[str]) -> tuple[float, float, float]:
    """The command's seconds, the script's wall time and its start-up, as the script timed them."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=True, env=ENV)
    own = truth(done.stdout)
    return time.perf_counter() - started, own["wall_s"], own["startup_s"]


def doctored(args: list[str]) -> tuple[float, float, float, dict[str, Any]]:
    """As `plain`, under the doctor (its own work inside the run taken out of the wall time), and the report."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "trainfast", "doctor", "--whole-run", "--max-seconds", "3600",
                               "--json", str(report), str(SCRIPT), "--", *args], capture_output=True, text=True,
                              check=True, env=ENV)
        command = time.perf_counter() - started
        whole = json.loads(report.read_text())["whole_run"]
    own = truth(done.stdout)
    set_up = whole["doctor_parts_s"].get("set-up", 0.0)  # the doctor importing itself: inside the script's start-up
    return command, own["wall_s"] - whole["doctor_s"], own["startup_s"] - set_up, whole


def per_step(rounds: int) -> dict[str, Any]:
    """The hooks' cost per step, in this process (module doc)."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from trainfast.diagnose.capture.instrument import Instrumentation
    from trainfast.diagnose.capture.ledger import Ledger
    from trainfast.diagnose.capture.timeline import Timeline
    from trainfast.monitor import Monitor

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8192, 64)
    y = (x[:, :8].sum(1) > 0).long()

    def run(steps: int) -> float:
        loader = DataLoader(TensorDataset(x[:64 * steps], y[:64 * steps]), batch_size=64, shuffle=True)
        started = time.perf_counter()
        for inputs, targets in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return (time.perf_counter() - started) / steps

    val = DataLoader(TensorDataset(x[:512], y[:512]), batch_size=64)

    def evaluate_and_save() -> float:
        """An evaluation pass (8 batches, model.eval() + no_grad), a print and a torch.save, as the script does."""
        started = time.perf_counter()
        model.eval()
        with torch.no_grad():
            correct = sum((model(v).argmax(1) == t).sum().item() for v, t in val)
        model.train()
        print(f"val acc {correct / 512:.3f}", file=io.StringIO())
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, io.BytesIO())
        return time.perf_counter() - started

    def hooked(whole: bool, monitor: bool = False, measure: Callable[[], float] = lambda: run(128)) -> float:
        ledger = Ledger(process_start=time.perf_counter()) if whole else None
        with contextlib.ExitStack() as stack:
            if monitor:  # the doctor's sampling thread, at its interval
                stack.enter_context(Monitor(interval_s=0.5))
            stack.enter_context(Instrumentation(Timeline(warmup_steps=5, max_steps=30), ledger=ledger))
            run(40)  # the warm-up, the scans for the model
            return measure()
    runs: dict[str, list[float]] = {"plain": [], "window": [], "whole_run": [], "whole_run_monitor": [],
                                    "evaluation_save_plain": [], "evaluation_save_whole_run": []}
    for _ in range(rounds):
        runs["plain"].append(run(128))
        runs["window"].append(hooked(False))
        runs["whole_run"].append(hooked(True))
        runs["whole_run_monitor"].append(hooked(True, monitor=True))
        runs["evaluation_save_plain"].append(evaluate_and_save())
        runs["evaluation_save_whole_run"].append(hooked(True, measure=evaluate_and_save))
    fastest = {name: min(values) for name, values in runs.items()}
    return {name: {"fastest_us": 1e6 * min(v), "median_us": 1e6 * statistics.median(v)} for name, v in runs.items()} \
        | {"whole_run_cost_us": 1e6 * (fastest["whole_run"] - fastest["plain"]),
           "whole_run_cost": fastest["whole_run"] / fastest["plain"] - 1,
           "monitor_cost_us": 1e6 * (fastest["whole_run_monitor"] - fastest["whole_run"]),
           "evaluation_save_cost_us": 1e6 * (fastest["evaluation_save_whole_run"] - fastest["evaluation_save_plain"]),
           "evaluation_save_cost": fastest["evaluation_save_whole_run"] / fastest["evaluation_save_plain"] - 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=20, help="end-to-end pairs (at least 1)")
    parser.add_argument("--epochs", type=int, default=20, help="epochs of 128 steps each (default: 20)")
    parser.add_argument("--rounds", type=int, default=15, help="rounds of the per-step part")
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args()
    if opts.pairs < 1 or opts.rounds < 1:
        parser.error(f"--pairs {opts.pairs} --rounds {opts.rounds}: give 1 or more of each")
    steps = per_step(opts.rounds)
    print(f"per step: plain {steps['plain']['fastest_us']:.0f} us, window hooks {steps['window']['fastest_us']:.0f} "
          f"us, whole-run hooks {steps['whole_run']['fastest_us']:.0f} us (fastest of {opts.rounds}; medians "
          f"{steps['plain']['median_us']:.0f} / {steps['window']['median_us']:.0f} / "
          f"{steps['whole_run']['median_us']:.0f} us): the whole run's hooks cost "
          f"{steps['whole_run_cost_us']:.0f} us a step ({steps['whole_run_cost']:+.1%}); the monitor thread beside "
          f"them {steps['monitor_cost_us']:+.0f} us a step; an evaluation pass + print + save "
          f"{steps['evaluation_save_plain']['fastest_us'] / 1e3:.2f} ms plain, "
          f"{steps['evaluation_save_cost_us'] / 1e3:+.2f} ms ({steps['evaluation_save_cost']:+.1%}) under the "
          "whole run's hooks", flush=True)
    args = ["--epochs", str(opts.epochs), "--samples", "8192", "--batch-size", "64", "--width", "256",
            "--eval-every", "100", "--eval-batches", "8", "--save-every", "500", "--workers", "0"]
    script, after, command, plain_s, goodput = [], [], [], [], []
    last: dict[str, Any] = {}
    for pair in range(opts.pairs):
        order = ("plain", "doctor") if pair % 2 == 0 else ("doctor", "plain")
        results: dict[str, Any] = {}
        for which in order:
            results[which] = plain(args) if which == "plain" else doctored(args)
        plain_command, plain_wall, plain_start = results["plain"]
        doctor_command, doctor_wall, doctor_start, last = results["doctor"]
        script.append(doctor_wall / plain_wall)
        after.append((doctor_wall - doctor_start) / (plain_wall - plain_start))
        command.append(doctor_command / plain_command)
        plain_s.append(plain_wall)
        goodput.append(last["goodput"])
        print(f"pair {pair + 1}: plain {plain_wall:.2f} s, under --whole-run {doctor_wall:.2f} s "
              f"({doctor_wall / plain_wall - 1:+.1%}; the doctor's own {last['doctor_s']:.2f} s left out), start-up "
              f"{plain_start:.2f} -> {doctor_start:.2f} s, after it {after[-1] - 1:+.1%}; command "
              f"{plain_command:.2f} -> {doctor_command:.2f} s", flush=True)
    result = {"script": str(SCRIPT.name), "args": args, "pairs": opts.pairs, "per_step": steps,
              "plain_wall_s": Spread.of(plain_s).__dict__,
              "script_overhead": Spread.of([r - 1 for r in script]).__dict__,
              "after_startup_overhead": Spread.of([r - 1 for r in after]).__dict__,
              "command_overhead": Spread.of([r - 1 for r in command]).__dict__,
              "goodput": Spread.of(goodput).__dict__, "steps": last["train"]["steps"],
              "step_ms": 1e3 * last["train"]["seconds"] / max(1, last["train"]["steps"]),
              "hardware": hardware()}
    s, a, c = result["script_overhead"], result["after_startup_overhead"], result["command_overhead"]
    print(f"{describe(result['hardware'])}: {result['steps']} steps of {result['step_ms']:.1f} ms; script overhead "
          f"{s['median']:+.1%} (IQR {s['low']:+.1%} to {s['high']:+.1%}), after start-up {a['median']:+.1%} (IQR "
          f"{a['low']:+.1%} to {a['high']:+.1%}), command overhead {c['median']:+.1%} (IQR {c['low']:+.1%} to "
          f"{c['high']:+.1%}) over {opts.pairs} interleaved pairs")
    if opts.json:
        write_json(opts.json, result)


if __name__ == "__main__":
    main()
