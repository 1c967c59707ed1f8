"""How stable are the doctor's verdicts? `trainfast doctor` run `--runs` times on each realistic script.

Each run is a fresh process (`python -m trainfast doctor --json ... SCRIPT -- ARGS`), the scripts taken
round-robin so that a slow spell of the machine touches every script alike. The scripts are those of
tests/integration/scripts/: the seeds' before_loop.py and classify_loop.py (workers 0 and 2) over the demo
dataset's training images, a DCGAN with two optimizers, nanoGPT's memmap loop, the word-language-model
loop with a manual SGD update, and Hugging Face-style dict batches tokenized in __getitem__. Reported per
script: the verdict of each run, how many agree with the most common one, the median samples/s with its
range, and the median data wait.

    python benchmarks/doctor_stability.py --json doctor_stability.json
    python benchmarks/doctor_stability.py --runs 1 --only gan_two_optimizers --threads 1

`--threads N` passes `--threads N` to every script (all take it): on a small machine shared with other
work, two intra-op threads spinning against other processes make step times swing tenfold.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from trainfast.atomic import write_json
from trainfast.bench.hardware import describe, hardware
from trainfast.data.synthetic import ensure_demo_dataset

SCRIPTS = Path(__file__).resolve().parents[1] / "tests" / "integration" / "scripts"


def configurations(images: Path, gpt_data: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (script, its arguments)."""
    return {
        "before_loop": ("before_loop.py", [str(images)]),
        "classify_loop_w0": ("classify_loop.py", [str(images), "--workers", "0"]),
        "classify_loop_w2": ("classify_loop.py", [str(images), "--workers", "2"]),
        "gan_two_optimizers": ("gan_two_optimizers.py", []),
        "memmap_gpt": ("memmap_gpt.py", ["--data-dir", str(gpt_data)]),
        "manual_sgd_lm": ("manual_sgd_lm.py", []),
        "dict_batches": ("dict_batches.py", []),
    }


def doctor_once(script: str, script_args: list[str], out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One `trainfast doctor` run in a fresh process: the fields of its JSON report this benchmark keeps."""
    cmd = [sys.executable, "-m", "trainfast", "doctor", "--json", str(out), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--max-seconds", str(args.max_seconds), str(SCRIPTS / script), "--",
           *script_args, *(["--threads", str(args.threads)] if args.threads else [])]
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              timeout=args.max_seconds + 120)
    except subprocess.TimeoutExpired:
        return {"error": f"no result after {args.max_seconds + 120:g} s", "wall_s": time.perf_counter() - started}
    wall = time.perf_counter() - started
    if not out.exists():
        return {"error": f"exit {proc.returncode}, no report: {proc.stderr.strip()[-500:]}", "wall_s": wall}
    report = json.loads(out.read_text())
    out.unlink()
    recommendations = report.get("recommendations") or []
    return {"verdict": report.get("verdict"), "samples_per_s": report.get("samples_per_s"),
            "data_wait_fraction": report.get("data_wait_fraction"), "steps_measured": report.get("steps_measured"),
            "step_signal": report.get("step_signal"), "input_source": report.get("input_source"),
            "outcome": (report.get("script") or {}).get("outcome"), "exit_code": proc.returncode,
            "top_fix": recommendations[0]["id"] if recommendations else None, "wall_s": wall}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    verdicts = [r.get("verdict") if "error" not in r else "error" for r in runs]
    # a run without a report agrees with nothing
    majority, agreeing = (Counter(v for v in verdicts if v != "error").most_common(1) or [("error", 0)])[0]
    rates = [r["samples_per_s"] for r in runs if r.get("samples_per_s") is not None]
    waits = [r["data_wait_fraction"] for r in runs if r.get("data_wait_fraction") is not None]
    return {"verdicts": verdicts, "majority": majority, "agreement": agreeing / len(runs),
            "samples_per_s": {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}
            if rates else None,
            "data_wait_median": statistics.median(waits) if waits else None}


def table(results: dict[str, dict[str, Any]], runs: int) -> str:
    lines = ["| script | verdicts | agreement | samples/s median (min–max) | data wait (median) |",
             "|---|---|---|---|---|"]
    for name, result in results.items():
        s = result["summary"]
        rate = s["samples_per_s"]
        rate_text = f"{rate['median']:,.0f} ({rate['min']:,.0f}–{rate['max']:,.0f})" if rate else "–"
        wait = f"{s['data_wait_median']:.0%}" if s["data_wait_median"] is not None else "–"
        verdicts = ", ".join(str(v) for v in s["verdicts"])
        lines.append(f"| {name} | {verdicts} | {round(s['agreement'] * runs)}/{runs} | {rate_text} | {wait} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="doctor runs per script (default: 5)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--max-seconds", type=float, default=120.0, help="the doctor's budget per run")
    parser.add_argument("--threads", type=int, default=None, help="pass --threads N to every script")
    parser.add_argument("--only", action="append", default=None, metavar="NAME",
                        help="run only this configuration (repeatable; e.g. memmap_gpt)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.getLogger("trainfast").setLevel(logging.WARNING)
    images = ensure_demo_dataset("quick") / "train"
    with tempfile.TemporaryDirectory(prefix="doctor_stability_") as tmp:
        work = Path(tmp)
        configs = configurations(images, work / "gpt")
        if args.only:
            unknown = set(args.only) - set(configs)
            if unknown:
                parser.error(f"unknown --only {sorted(unknown)}; choose from {sorted(configs)}")
            configs = {k: v for k, v in configs.items() if k in args.only}
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
        for r in range(args.runs):  # round-robin: a noisy minute falls on every script alike
            for name, (script, script_args) in configs.items():
                result = doctor_once(script, script_args, work / "report.json", args)
                runs[name].append(result)
                print(f"run {r + 1}/{args.runs} {name}: {result.get('verdict', result.get('error'))} "
                      f"({result['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    results = {name: {"script": configs[name][0], "args": configs[name][1], "runs": runs[name],
                      "summary": summarise(runs[name])} for name in configs}
    report = {"runs": args.runs, "steps": args.steps, "warmup": args.warmup, "max_seconds": args.max_seconds,
              "threads": args.threads, "results": results, "hardware": hardware()}
    print(describe(report["hardware"]))
    print(f"{args.runs} doctor runs per script, {args.steps} steps after {args.warmup} warm-up"
          + (f", scripts on {args.threads} thread(s)" if args.threads else ""))
    print(table(results, args.runs))
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
