"""Where the demo's speed-up comes from: the naive run, then trainfast with practices turned on one by one.

Variants (same model, data and steps as `trainfast demo --quick`), interleaved, `--repeats` rounds:
  naive                 the seeds' loop: no workers, full decode, float32 samples, fp32, .item() every step
  + workers/threads     make_loader + Trainer auto split of the cores, uint8 samples, full decode, NCHW, fp32
  + channels_last       ... and the NHWC memory format for the ConvNet (oneDNN's fast layout; "auto": A/B-confirmed)
  + draft decode        ... and JPEGs decoded straight to the needed DCT scale
  + bf16 autocast       ... and precision "auto": bf16-mixed where the CPU has native bf16, confirmed by an A/B
                        against fp32 on the first steps (everything auto: the demo's run)
  + compile auto        ... and compile="auto" (only with --compile: each run pays a compile)
  A/Bs pinned           everything as "+ bf16 autocast" with the outcome of its two A/Bs given (bf16-mixed,
                        channels_last=True: what they choose on a CPU with native bf16): "+ bf16 autocast" over
                        this is what the A/Bs cost
  thread workers        everything auto as "+ bf16 autocast", the training loader's worker a thread of the
                        training process (backend="threads") instead of a process: what "auto" would gain by
                        choosing threads here

    python benchmarks/demo_ablation.py --json demo_ablation.json
    python benchmarks/demo_ablation.py --variants naive,"+ bf16 autocast","thread workers" --repeats 6
    python benchmarks/demo_ablation.py --variants "+ bf16 autocast","A/Bs pinned" --repeats 6
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

from trainfast.atomic import write_json
from trainfast.bench.demo import QUICK, run_naive, run_trainfast
from trainfast.bench.hardware import describe, hardware
from trainfast.bench.timing import Spread, interleave, ratios
from trainfast.data.images import ImageFolder
from trainfast.data.synthetic import ensure_demo_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--compile", action="store_true", help="add the compile='auto' variant")
    parser.add_argument("--variants", default=None, help="comma-separated names to run (default: all; 'naive' "
                                                         "is always run, the ratios are to it)")
    args = parser.parse_args()
    logging.getLogger("trainfast").setLevel(logging.WARNING)
    root = ensure_demo_dataset(QUICK.dataset, seed=QUICK.seed)
    per_epoch = len(ImageFolder(root / "train")) // QUICK.batch_size
    accuracy: dict[str, list[float]] = {}

    def variant(name: str, run: Callable[[], object]) -> Callable[[], float]:
        def measure() -> float:
            stats = run()
            accuracy.setdefault(name, []).append(stats.val_accuracy)  # type: ignore[attr-defined]
            return float(stats.samples_per_s)  # type: ignore[attr-defined]
        return measure

    variants = {
        "naive": variant("naive", lambda: run_naive(QUICK, root, per_epoch)),
        "+ workers/threads": variant("+ workers/threads", lambda: run_trainfast(
            QUICK, root, per_epoch, decode="full", channels_last=False, precision="32-true")),
        "+ channels_last": variant("+ channels_last", lambda: run_trainfast(
            QUICK, root, per_epoch, decode="full", channels_last="auto", precision="32-true")),
        "+ draft decode": variant("+ draft decode", lambda: run_trainfast(QUICK, root, per_epoch,
                                                                           precision="32-true")),
        "+ bf16 autocast": variant("+ bf16 autocast", lambda: run_trainfast(QUICK, root, per_epoch)),
    }
    variants["A/Bs pinned"] = variant("A/Bs pinned", lambda: run_trainfast(QUICK, root, per_epoch,
                                                                           precision="bf16-mixed", channels_last=True))
    if args.compile:
        variants["+ compile auto"] = variant("+ compile auto", lambda: run_trainfast(QUICK, root, per_epoch,
                                                                                     compile_model="auto"))
    variants["thread workers"] = variant("thread workers", lambda: run_trainfast(QUICK, root, per_epoch,
                                                                                 backend="threads"))
    if args.variants:
        wanted = {"naive", *(name.strip() for name in args.variants.split(","))}
        unknown = wanted - set(variants)
        if unknown:
            parser.error(f"--variants: unknown {', '.join(sorted(unknown))}; choose from {', '.join(variants)}")
        variants = {name: run for name, run in variants.items() if name in wanted}
    rates = interleave(variants, repeats=args.repeats, warmup=0)
    rows = []
    print(describe(hardware()))
    print(f"{'variant':<20}{'samples/s':>12}{'x naive':>10}  range")
    for name, values in rates.items():
        speedup = Spread.of(ratios(values, rates["naive"]))
        rows.append({"variant": name, "samples_per_s": Spread.of(values).to_json(), "speedup": speedup.to_json(),
                     "val_accuracy": accuracy[name]})
        print(f"{name:<20}{Spread.of(values).median:>12,.0f}{speedup.median:>9.2f}x  "
              f"{speedup.minimum:.2f}-{speedup.maximum:.2f}")
    if args.json:
        write_json(args.json, {"variants": rows, "repeats": args.repeats, "hardware": hardware()})


if __name__ == "__main__":
    main()
