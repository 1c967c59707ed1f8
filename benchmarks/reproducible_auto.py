"""Does "auto" cost reproducibility? Two `trainfast train --epochs 2 --limit-batches 30 --seed 0` runs with every
"auto" on (precision, channels_last, workers, threads, and `--compile auto`): one uninterrupted, one stopped by
SIGTERM in epoch 2 and resumed. Their final weights must be bit-identical whenever their choices agree.

    python benchmarks/reproducible_auto.py --json repro.json [--rounds 3] [-- EXTRA TRAIN ARGS]

Each round prints both runs' choices and whether the weights are identical; the JSON holds every round.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from trainfast.atomic import write_json
from trainfast.bench.hardware import hardware

STEP = re.compile(r"epoch 2/2 step \d+")
PRACTICES = ("precision", "channels_last", "compile")


def train(ckpt: Path, out: Path, extra: list[str], *, resume: bool = False) -> list[str]:
    return [sys.executable, "-m", "trainfast", "train", "--epochs", "2", "--limit-batches", "30", "--seed", "0",
            "--compile", "auto", "--checkpoint-dir", str(ckpt), "--json", str(out), "--progress",
            "--log-interval-s", "0.05", *(["--resume"] if resume else []), *extra]


def stopped_in_epoch_2(ckpt: Path, out: Path, extra: list[str]) -> int:
    """Run until the progress log (a line every 0.05 s off a terminal) shows epoch 2, then SIGTERM; the step it
    stopped at."""
    proc = subprocess.Popen(train(ckpt, out, extra), stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        if STEP.search(line):
            proc.send_signal(signal.SIGTERM)
            break
    proc.communicate(timeout=300)
    if proc.returncode != 143:
        raise RuntimeError(f"the stopped run exited {proc.returncode}, not 143 (it ended before the signal?)")
    return int(torch.load(ckpt / "last.pt", weights_only=True)["step"])


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return dict(torch.load(ckpt / "last.pt", weights_only=True)["model"])


def choices(out: Path) -> dict[str, str]:
    result = json.loads(out.read_text())
    return {name: (result.get(name) or {}).get("chosen") for name in PRACTICES}


def one_round(root: Path, extra: list[str]) -> dict[str, Any]:
    started = time.perf_counter()
    subprocess.run(train(root / "a", root / "a.json", extra), check=True, capture_output=True)
    stop_step = stopped_in_epoch_2(root / "b", root / "b.json", extra)
    subprocess.run(train(root / "b", root / "b.json", extra, resume=True), check=True, capture_output=True)
    total = json.loads((root / "a.json").read_text())["steps"]
    if not 0 < stop_step < total:
        raise RuntimeError(f"the stop came at step {stop_step} of {total}: not within the run")
    a, b = weights(root / "a"), weights(root / "b")
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return {"uninterrupted": choices(root / "a.json"), "resumed": choices(root / "b.json"),
            "stopped_at_step": stop_step, "bit_identical": same, "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("extra", nargs="*", help="more `trainfast train` arguments (after --)")
    args = parser.parse_args()
    rounds = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            row = one_round(Path(tmp), args.extra)
        agree = row["uninterrupted"] == row["resumed"]
        print(f"round {i + 1}: choices {'agree' if agree else 'differ'} {row['uninterrupted']} / {row['resumed']}; "
              f"stopped at step {row['stopped_at_step']}; weights "
              f"{'bit-identical' if row['bit_identical'] else 'DIFFERENT'} ({row['seconds']:.0f} s)", flush=True)
        rounds.append(row)
    if args.json:
        write_json(args.json, {"rounds": rounds, "hardware": hardware(), "extra": args.extra})


if __name__ == "__main__":
    main()
