"""`trainfast compare --fail-slower 5` as a CI gate, on real runs: is the same script ever called slower, and is a
script made 15 % slower found?

The script is tests/integration/scripts/gan_two_optimizers.py (PyTorch's DCGAN example in its shape: two models,
two optimizers a step). The slowed version is a copy of it that spins on the clock after the generator's step for
`--slower` of the step's time (the fastest of 3 first doctor runs). A spin, not a sleep: a 5 ms `time.sleep` in a
34 ms step measured 26-31 % slower here (the intra-op threads go idle and wake), not 15 %. Two parts:

- `--singles N`: N pairs of one `trainfast doctor --json` report a side of the same script, each pair gated with
  `trainfast compare --fail-slower 5 a.json b.json` (one report a side: the gate must never exit 1 on them);
- `--trials N`: N gates of `trainfast compare --runs 3 --fail-slower 5 SCRIPT SLOWED` (it extends itself up to
  --max-runs, 12 a side), and N of `compare --runs 3 --fail-slower 5 SCRIPT SCRIPT`, alternately; counted: exit
  codes, and the runs each took.

    python benchmarks/compare_gate.py --singles 20 --trials 10 --json compare_gate.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from trainfast.atomic import write_json
from trainfast.bench.hardware import describe, hardware

SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "integration" / "scripts" / "gan_two_optimizers.py"
STEPS = ["--steps", "30"]


def doctor(script: Path, path: Path) -> dict[str, Any]:
    subprocess.run([sys.executable, "-m", "trainfast", "doctor", *STEPS, "--json", str(path), str(script)],
                   capture_output=True, text=True, check=True)
    return dict(json.loads(path.read_text()))


def slowed(folder: Path, spin_s: float) -> Path:
    """The script spinning `spin_s` on the clock after each generator step: the same model and data, slower."""
    source = SCRIPT.read_text()
    line = next(x for x in source.splitlines() if x.strip() == "optimizerG.step()")
    indent = line[: len(line) - len(line.lstrip())]
    spin = f"{indent}_t = time.perf_counter()\n{indent}while time.perf_counter() - _t < {spin_s!r}:\n{indent}    pass"
    out = folder / "gan_slowed.py"
    out.write_text("import time\n" + source.replace(line, f"{line}\n{spin}", 1))
    return out


def compare(*args: str) -> tuple[int, str, dict[str, Any]]:
    """compare's exit code, its verdict line and its JSON."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "cmp.json"
        done = subprocess.run([sys.executable, "-m", "trainfast", "compare", "--fail-slower", "5", "--json", str(out),
                               *args], capture_output=True, text=True)
        payload = json.loads(out.read_text()) if out.exists() else {}
    lines = [x for x in done.stdout.splitlines() if "→ exit" in x] or done.stderr.strip().splitlines()[-1:]
    return done.returncode, " ".join(lines[-1].split()) if lines else "", payload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--singles", type=int, default=20, help="pairs of one report a side of the same script")
    parser.add_argument("--trials", type=int, default=10, help="--runs gates of each kind (slowed, same)")
    parser.add_argument("--slower", type=float, default=0.15, help="how much slower the slowed copy is made")
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args()
    result: dict[str, Any] = {"hardware": hardware(), "slower": opts.slower, "steps": int(STEPS[1])}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # the step's time: the fastest of 3 runs (a run slowed by other work would make the sleep too short a share)
        rates = [doctor(SCRIPT, root / f"first{i}.json")["samples_per_s"] for i in range(3)]
        step_s = 32 / max(rates)  # batches of 32
        script = slowed(root, opts.slower * step_s)
        print(f"a step: {step_s * 1e3:.1f} ms; the slowed copy spins {opts.slower * step_s * 1e3:.1f} ms a step",
              flush=True)
        result["step_s"], result["spin_s"] = step_s, opts.slower * step_s
        singles = []
        for i in range(opts.singles):
            a, b = doctor(SCRIPT, root / f"a{i}.json"), doctor(SCRIPT, root / f"b{i}.json")
            code, line, _ = compare(str(root / f"a{i}.json"), str(root / f"b{i}.json"))
            singles.append({"exit": code, "verdict": line, "change": b["samples_per_s"] / a["samples_per_s"] - 1})
            print(f"single {i + 1}: {singles[-1]['change']:+.1%} -> exit {code}: {line}", flush=True)
        trials: dict[str, list[dict[str, Any]]] = {"slowed": [], "same": []}
        for i in range(opts.trials):
            for kind, new in (("slowed", script), ("same", SCRIPT)):
                code, line, payload = compare("--runs", "3", str(SCRIPT), str(new), *STEPS)
                runs = payload.get("runs", {}).get("base")
                trials[kind].append({"exit": code, "verdict": line, "runs_a_side": runs,
                                     "slowdown_pct": payload.get("slowdown", {}).get("pct")})
                print(f"{kind} {i + 1}: {runs} runs a side -> exit {code}: {line}", flush=True)
    result["singles"] = singles
    result["singles_exits"] = dict(Counter(str(s["exit"]) for s in singles))
    result["singles_change_pct"] = [round(100 * s["change"], 1) for s in singles]
    result["trials"] = trials
    for kind, rows in trials.items():
        result[f"{kind}_exits"] = dict(Counter(str(r["exit"]) for r in rows))
        sizes = [r["runs_a_side"] for r in rows if r["runs_a_side"]]
        result[f"{kind}_runs_a_side"] = {"median": statistics.median(sizes) if sizes else None,
                                         "min": min(sizes, default=None), "max": max(sizes, default=None)}
    measured = [r["slowdown_pct"] for r in trials["slowed"] if r["slowdown_pct"] is not None]
    result["slowed_measured_pct"] = statistics.median(measured) if measured else None
    print(f"the slowed copy measured {result['slowed_measured_pct']} % slower (median of its gates' estimates)")
    print(f"{describe(result['hardware'])}: one report a side, same script: exits {result['singles_exits']} of "
          f"{opts.singles}; --runs 3: {opts.slower:.0%} slowed exits {result['slowed_exits']} (runs a side "
          f"{result['slowed_runs_a_side']}), same script exits {result['same_exits']} (runs a side "
          f"{result['same_runs_a_side']})")
    if opts.json:
        write_json(opts.json, result)


if __name__ == "__main__":
    main()
