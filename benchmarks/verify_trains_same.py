"""Does `--verify` call a fix "trains differently" where it does not? `trainfast doctor --verify` run `--verifies`
times on an unseeded script whose dataset the loop never touches: each run draws its own data, noise and initial
weights, so the baselines and the fix's run differ by those draws alone, and no fix changes what is learned. Counted:
the fixes reported with `trains_same: false` (each a false "trains differently"). Then, over every run's loss
(baselines and fixes alike: all are draws of the same training), the rule's ratio for each triple of runs (one as
the fix, two as its baselines): |fix - mean(baselines)| / their spread (records/losses.py `trains_same`), whose
largest value is how close the rule's `SPREADS` comes to a false call, and the same with the baselines' range alone
(no step-to-step sd), which shows why the sd is in the spread.

The scripts: tests/integration/scripts/curriculum.py --fixed (in-memory data, ~3 ms of CPU a sample, the targets'
noise never changed: the doctor offers 2 loader workers) and the seeds' before_loop.py over the demo images (JPEG
decode in the main process, `--threads 1`).

    python benchmarks/verify_trains_same.py --verifies 10
    python benchmarks/verify_trains_same.py --verifies 10 --script before_loop --json trains_same.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trainfast.atomic import write_json
from trainfast.bench.hardware import describe, hardware
from trainfast.data.synthetic import DemoSize, ensure_demo_dataset
from trainfast.diagnose.records.losses import SPREADS, LossTrace, tail

SCRIPTS = Path(__file__).resolve().parents[1] / "tests" / "integration" / "scripts"
TINY = DemoSize(name="tiny", train_per_class=8, val_per_class=4)


def script_of(name: str, data: Path) -> tuple[Path, list[str]]:
    if name == "curriculum":
        return SCRIPTS / "curriculum.py", ["--fixed", "--noise", "0.5"]
    return SCRIPTS / "before_loop.py", [str(ensure_demo_dataset(TINY, root=data / "tiny", processes=1) / "train"),
                                        "--threads", "1"]


def verify_once(script: Path, script_args: list[str], out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One `trainfast doctor --verify` in a fresh process: its report's `verify` record."""
    cmd = [sys.executable, "-m", "trainfast", "doctor", "--verify", "--json", str(out), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--max-seconds", "120", str(script), "--", *script_args]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
    verify: dict[str, Any] = json.loads(out.read_text())["verify"]
    return verify


def _trace(run: dict[str, Any]) -> LossTrace:
    steps = run["loss_steps"]
    return LossTrace(run["loss_from"], tuple(run["losses"]), (steps[0], steps[1]) if steps else None)


def triples(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The rule's ratio |run - mean(two others)| / their spread over every (fix, two baselines) triple of runs,
    compared over the second half of the baselines' measured steps (the same window for all: the same --warmup)."""
    window = tail(next(_trace(r).steps for r in runs if r["fix"] == "baseline" and r["loss_steps"]))
    overs = [o for o in (_trace(r).over(window) for r in runs if not r["error"]) if o is not None]
    ratio, range_only = [], []
    for i, (j, k) in itertools.product(range(len(overs)), itertools.combinations(range(len(overs)), 2)):
        if i in (j, k):
            continue
        f, b = overs[i][0], [overs[j][0], overs[k][0]]
        gap, centre = max(b) - min(b), statistics.fmean(b)
        ratio.append(abs(f - centre) / max(gap, overs[j][1], overs[k][1]))
        range_only.append(abs(f - centre) / gap if gap > 0 else float("inf"))
    ratio.sort()
    range_only.sort()
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    return {"runs": len(overs), "triples": len(ratio), "window": list(window), "max": ratio[-1],
            "p99": q(ratio, 0.99), "p50": q(ratio, 0.5), "range_only_max": range_only[-1],
            "range_only_p99": q(range_only, 0.99), "losses": [o[0] for o in overs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--verifies", type=int, default=10)
    parser.add_argument("--script", choices=("curriculum", "before_loop"), default="curriculum")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    print(describe(hardware()), flush=True)
    started = time.perf_counter()
    results, runs = [], []
    with tempfile.TemporaryDirectory(prefix="trainfast-trains-same-") as tmp:
        script, script_args = script_of(args.script, Path(tmp))
        for n in range(args.verifies):
            verify = verify_once(script, script_args, Path(tmp) / f"report{n}.json", args)
            runs.extend(verify["runs"])
            for fix_id, gain in verify["gains"].items():
                loss = gain.get("loss") or {}
                results.append({"verify": n, "fix": fix_id, "trains_same": gain["trains_same"],
                                "verdict": (gain.get("decision") or {}).get("verdict"), "loss": loss})
                said = (f"loss {loss['fix']:.4g} vs {loss['baseline']:.4g}, limit {loss['limit']:.3g} "
                        f"({abs(loss['fix'] - loss['baseline']) / loss['limit']:.2f} of it)"
                        if loss.get("fix") is not None else loss.get("reason"))
                print(f"verify {n + 1}/{args.verifies}: {fix_id}: trains_same={gain['trains_same']} "
                      f"({(gain.get('decision') or {}).get('verdict')}); {said}", flush=True)
    false = [r for r in results if r["trains_same"] is False]
    spread = triples(runs)
    print(f"\n{args.script}: {len(false)} false 'trains differently' of {len(results)} fixes verified in "
          f"{args.verifies} --verify runs ({time.perf_counter() - started:.0f} s)")
    print(f"the rule's ratio over {spread['triples']} triples of {spread['runs']} runs (steps "
          f"{spread['window'][0]}-{spread['window'][1]}): max {spread['max']:.2f}, p99 {spread['p99']:.2f}, "
          f"median {spread['p50']:.2f} (SPREADS = {SPREADS:g}); the baselines' range alone: max "
          f"{spread['range_only_max']:.1f}, p99 {spread['range_only_p99']:.1f}")
    if args.json is not None:
        write_json(args.json, {"hardware": hardware(), "script": args.script, "verifies": args.verifies,
                               "false_trains_differently": len(false), "fixes": results, "triples": spread})


if __name__ == "__main__":
    main()
