"""How good and how cheap is the tuner? Its choice vs the exhaustive sweep's best, and its time vs the sweep's.

Workload: the quick demo dataset (64 px JPEGs), batch 64, the reference ConvNet's training step co-running,
on this machine's device. The exhaustive sweep measures every configuration the tuner searches over
(workers 0..N as processes or as threads, prefetch 2 or 4, and on the CPU every intra-op thread count 1..N; pinned
memory too on CUDA), each for `--batches` batches. The tuner's trials are capped at the same count and stop earlier
once their rate is known (or clearly too low to matter). The chosen and the best configurations are then measured
again, interleaved, `--repeats` times, so that the quality ratio is not one noisy trial against another. The search's
time is reported against the sweep's, and the tuner's whole time too (the search, then its choice run against
"auto" in interleaved rounds: `trainfast.tune.confirm`).

    python benchmarks/tuner_quality.py --json tuner_quality.json
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import time
from typing import Any

import torch

from trainfast.atomic import write_json
from trainfast.bench.hardware import describe, hardware
from trainfast.bench.timing import Spread, interleave, ratios
from trainfast.data.images import ImageFolder
from trainfast.data.models import build_model
from trainfast.data.synthetic import ensure_demo_dataset
from trainfast.host import available_cpus
from trainfast.tune.search import cheapest_within
from trainfast.tune.step import training_step
from trainfast.tune.trial import Trial, WorkerSettings, run_trial
from trainfast.tune.tuner import tune_loader


def grid(cpus: int, cpu_training: bool, cuda: bool) -> list[WorkerSettings]:
    threads: list[int | None] = list(range(1, cpus + 1)) if cpu_training else [None]
    configs = [WorkerSettings(0, None, False, t) for t in threads]
    for backend, workers, prefetch, pin, t in itertools.product(("processes", "threads"), range(1, cpus + 1), (2, 4),
                                                                (False, True) if cuda else (False,), threads):
        configs.append(WorkerSettings(workers, prefetch, pin, t, backend))
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=60.0, help="the tuner's budget")
    parser.add_argument("--batches", type=int, default=40, help="measured batches per sweep trial")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.getLogger("trainfast").setLevel(logging.WARNING)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dataset = ImageFolder(ensure_demo_dataset("quick") / "train", image_size=64)
    torch.manual_seed(0)
    step = training_step(build_model("convnet", num_classes=10, image_size=64), normalize=dataset.normalize,
                         device=device)
    cpus, cpu_training = available_cpus(), device.type == "cpu"

    def measure(config: WorkerSettings, batches: int = args.batches) -> Trial:
        warmup = 2 + config.num_workers * (config.prefetch_factor or 2)
        return run_trial(dataset, 64, config, step_fn=step, batches=batches, warmup=warmup, device=device.type)

    # Trials capped at the sweep's batch count: without early stopping a tuner trial is a sweep trial.
    tuned = tune_loader(dataset, 64, step, budget_s=args.budget_s, device=device.type, save=False,
                        batches=args.batches)
    started = time.perf_counter()
    sweep = [measure(c) for c in grid(cpus, cpu_training, device.type == "cuda")]
    sweep_s = time.perf_counter() - started
    best = cheapest_within(sweep, tolerance=0.0)
    rates = interleave({"chosen": lambda: measure(tuned.chosen).samples_per_s,
                        "best": lambda: measure(best.config).samples_per_s}, repeats=args.repeats, warmup=0)
    quality = Spread.of(ratios(rates["chosen"], rates["best"]))
    search_s = tuned.search_seconds if tuned.search_seconds is not None else tuned.sweep_seconds
    report: dict[str, Any] = {
        "chosen": tuned.chosen.to_json(), "sweep_best": best.config.to_json(),
        "quality": quality.median, "quality_spread": quality.to_json(), "goal_quality": 0.95,
        "chosen_samples_per_s": statistics.median(rates["chosen"]),
        "best_samples_per_s": statistics.median(rates["best"]),
        "tuner_seconds": tuned.sweep_seconds, "search_seconds": search_s, "sweep_seconds": sweep_s,
        "time_ratio": search_s / sweep_s, "time_ratio_with_confirmation": tuned.sweep_seconds / sweep_s,
        "goal_time_ratio": 0.25, "kept_reason": tuned.kept_reason, "tuner_trials": len(tuned.trials),
        "sweep_trials": len(sweep),
        "tuner_batches": sum(t.batches for t in tuned.trials), "sweep_batches": sum(t.batches for t in sweep),
        "sweep": [t.to_json() for t in sweep], "tuner_trials_detail": [t.to_json() for t in tuned.trials],
        "hardware": hardware()}
    print(describe(report["hardware"]))
    print(f"tuner chose   {tuned.chosen.label():<48} in {tuned.sweep_seconds:5.1f} s, {len(tuned.trials)} trials, "
          f"{report['tuner_batches']} measured batches")
    print(f"sweep best    {best.config.label():<48} in {sweep_s:5.1f} s, {len(sweep)} trials, "
          f"{report['sweep_batches']} measured batches")
    print(f"quality       chosen / best = {quality.median:.3f} (median of {args.repeats} interleaved re-measurements, "
          f"range {quality.minimum:.3f}-{quality.maximum:.3f}); goal >= 0.95")
    print(f"against auto  {tuned.kept_reason}")
    print(f"search time   {report['time_ratio']:.0%} of the exhaustive sweep's ({search_s:.1f} s); goal <= 25%; "
          f"with the confirmation against auto {report['time_ratio_with_confirmation']:.0%}")
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
