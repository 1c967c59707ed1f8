"""Does what `--verify` measured hold for the real run? The input-bound test script, verified, then run to its end
three ways, each timed by the script itself (its own samples/s over its training, outside anything trainfast
measures), interleaved: as it is, under `trainfast run --apply REPORT`, and patched by `--patch` (git apply).

    python benchmarks/apply_vs_verified.py --json apply_vs_verified.json

The goal (issue: from report to faster run): run --apply reaches at least 0.9x the gain `--verify` measured for the
set of fixes it applies, and so does the patched script.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from trainfast.atomic import write_json
from trainfast.bench.hardware import describe, hardware
from trainfast.bench.timing import Spread, interleave, ratios

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "integration" / "scripts" / "slow_reads.py"
RATE = re.compile(r": ([0-9.]+) samples/s")


def _rate(command: list[str], cwd: Path) -> float:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600, check=True)
    found = RATE.search(done.stdout)
    assert found, done.stdout
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", type=int, default=4096, help="each timed run's samples (default: 4096)")
    parser.add_argument("--verify-repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="apply-vs-verified-") as tmp:
        folder, patched = Path(tmp) / "script", Path(tmp) / "patched"  # (patched/: outside the script's repo)
        folder.mkdir()
        patched.mkdir()
        shutil.copy(SCRIPT, folder / "slow_reads.py")
        script_args = ["--samples", str(args.samples)]
        subprocess.run(["git", "init", "-q"], cwd=folder, check=True)
        subprocess.run([sys.executable, "-m", "trainfast", "doctor", "--verify", "--verify-repeats",
                        str(args.verify_repeats), "--json", "report.json", "--patch", "fixes.diff", "slow_reads.py",
                        "--", *script_args], cwd=folder, check=True, capture_output=True, text=True, timeout=1800)
        report = json.loads((folder / "report.json").read_text())
        together = report["verify"]["set"]
        shutil.copy(folder / "slow_reads.py", patched / "slow_reads.py")
        subprocess.run(["git", "apply", str(folder / "fixes.diff")], cwd=patched, check=True)
        plain = [sys.executable, "slow_reads.py", *script_args]
        rates = interleave({
            "plain": lambda: _rate(plain, folder),
            "run --apply": lambda: _rate([sys.executable, "-m", "trainfast", "run", "--apply", "report.json",
                                          "slow_reads.py", "--", *script_args], folder),
            "patched": lambda: _rate(plain, patched),
        }, repeats=args.repeats)
    applied = Spread.of(ratios(rates["run --apply"], rates["plain"]))
    patched_gain = Spread.of(ratios(rates["patched"], rates["plain"]))
    verified = together["median"]
    result = {"set": together, "verified_gain": verified, "applied_gain": applied.to_json(),
              "patched_gain": patched_gain.to_json(), "samples_per_s": {k: Spread.of(v).to_json()
                                                                        for k, v in rates.items()},
              "applied_over_verified": applied.median / verified,
              "patched_over_verified": patched_gain.median / verified,
              "repeats": args.repeats, "samples": args.samples, "hardware": hardware()}
    print(describe(result["hardware"]))
    print(f"verified ({' + '.join(together['ids'])}): {verified:.2f}x "
          f"({together['min']:.2f}-{together['max']:.2f}x over {together['measured_repeats']} repeat(s))")
    for name, gain in (("run --apply", applied), ("patched", patched_gain)):
        print(f"{name}: {gain.median:.2f}x the plain script (range {gain.minimum:.2f}-{gain.maximum:.2f}, "
              f"{args.repeats} interleaved rounds): {gain.median / verified:.2f} of the verified gain")
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
