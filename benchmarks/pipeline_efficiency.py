"""Pipeline efficiency: trained samples/s divided by the slower of its two halves measured alone.

At the tuned configuration (`trainfast tune`'s choice, tuned here first if needed) on the quick demo
workload (64 px JPEGs, batch 64, the reference ConvNet):
  - compute-only: the training step of a fresh model replayed over 8 cached batches (no loading at all; one
    batch replayed alone overfits, and the vanishing gradients run into slow denormal arithmetic on CPUs);
  - loader-only: the loader iterated with no step;
  - trained: `Trainer.fit` fed by `make_loader(..., workers="tuned")` — the product's own path, with precision and
    channels_last pinned to the compute-only step's (the "auto" priors), so that all three run the same step.
efficiency = trained / min(compute-only, loader-only). 1.0 means loading is entirely hidden behind compute
(or the reverse) and the Trainer adds nothing. That is the limit where compute runs on an accelerator; on a
CPU-only machine loading and compute share the cores, so it is out of reach and hides where time goes. There the
CPU-work limit applies too: with c1 = compute alone at one intra-op thread and l1 = the loader alone with one
worker process (samples/s on one core each), N usable cores train at most N * c1 * l1 / (c1 + l1) samples/s
(each sample costs 1/c1 + 1/l1 core-seconds); `efficiency_vs_cpu_limit` = trained / that. `trained_auto` is the same
`Trainer.fit` fed by `make_loader(..., workers="auto")` (auto's threads too): `tuned_vs_auto` = trained / that, per
round, is what the tuning bought end to end (the goal: >= 1, i.e. never slower). Rounds interleaved,
`--repeats` times. The loader runs with the tuned backend (worker processes or loader threads, whichever the
tuning chose); `--backend` overrides it to compare the two at the tuned worker count, `--retune` tunes again
instead of reading the cached result.

    python benchmarks/pipeline_efficiency.py --json pipeline_efficiency.json
    python benchmarks/pipeline_efficiency.py --backend threads --repeats 3
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from trainfast.atomic import write_json
from trainfast.bench.hardware import describe, hardware
from trainfast.bench.timing import Spread, interleave, ratios
from trainfast.data.images import ImageFolder
from trainfast.data.models import build_model
from trainfast.data.synthetic import ensure_demo_dataset
from trainfast.host import available_cpus
from trainfast.loader.make import make_loader
from trainfast.precision.policy import device_caps, resolve_precision
from trainfast.trainer.config import TrainConfig
from trainfast.trainer.loop import Trainer
from trainfast.trainer.settings import torch_settings
from trainfast.trainer.step import resolve_channels_last
from trainfast.tune.result import load
from trainfast.tune.step import training_step
from trainfast.tune.trial import WorkerSettings, run_trial
from trainfast.tune.tuner import tune_loader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", choices=("tuned", "processes", "threads"), default="tuned",
                        help="the loader's workers: the tuning's choice, or processes / threads at its worker count")
    parser.add_argument("--retune", action="store_true", help="tune again even if a result is cached")
    parser.add_argument("--budget-s", type=float, default=90.0, help="the tuning's budget when it runs (default: 90)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.getLogger("trainfast").setLevel(logging.WARNING)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    root = ensure_demo_dataset("quick")
    dataset = ImageFolder(root / "train", image_size=64)
    step = training_step(build_model("convnet", num_classes=10, image_size=64), normalize=dataset.normalize,
                         device=device)
    tuned = (None if args.retune else load(dataset, 64, device=device.type)) or tune_loader(
        dataset, 64, step, device=device.type, budget_s=args.budget_s)
    config: WorkerSettings = tuned.chosen
    precision = resolve_precision("auto", device_caps(device)).name
    if args.backend != "tuned":
        config = replace(config, backend=args.backend)
    cached = [batch for _, batch in zip(range(8), make_loader(dataset, 64, workers=0), strict=False)]

    def compute_only(threads: int | None = config.cpu_threads) -> float:
        torch.manual_seed(0)
        fresh = training_step(build_model("convnet", num_classes=10, image_size=64), normalize=dataset.normalize,
                              device=device)
        with torch_settings(cpu_threads=threads):
            fresh(cached[0])
            started = time.perf_counter()
            for i in range(args.batches):
                fresh(cached[i % len(cached)])
            if device.type == "cuda":
                torch.cuda.synchronize()
            return float(64 * args.batches / (time.perf_counter() - started))

    def loader_only(settings: WorkerSettings = config) -> float:
        warmup = 2 + settings.num_workers * (settings.prefetch_factor or 2)
        return float(run_trial(dataset, 64, settings, step_fn=None, batches=args.batches, warmup=warmup,
                               device=device.type).samples_per_s)

    one_worker = replace(config, num_workers=1, backend="processes", prefetch_factor=config.prefetch_factor or 2)

    def trained(workers: str = "tuned") -> float:
        torch.manual_seed(0)
        model = build_model("convnet", num_classes=10, image_size=64)
        if workers == "auto":
            loader = make_loader(dataset, 64, device=device.type)
        elif args.backend == "tuned":
            loader = make_loader(dataset, 64, workers="tuned", device=device.type)
        else:
            loader = make_loader(dataset, 64, workers=config.num_workers, prefetch_factor=config.prefetch_factor
                                 or "auto", pin_memory=config.pin_memory, device=device.type, backend=args.backend)
            assert loader.plan is not None and loader.plan.backend == (config.backend if config.num_workers else
                                                                       "processes")
        threads = config.cpu_threads if args.backend != "tuned" and config.cpu_threads else "auto"  # tuned: the plan's
        # precision and channels_last pinned to what the compute-only step runs ("auto"'s priors): the Trainer's
        # A/Bs of the other settings are a cost of their own (BENCHMARKS.md), not the pipeline's
        cfg = TrainConfig(epochs=2, limit_batches=args.batches // 2 + 2, cpu_threads=threads, progress=False,
                          precision=precision,
                          channels_last=resolve_channels_last("auto", model, device, precision != "32-true"),
                          device=device.type)
        return Trainer(model, config=cfg).fit(loader).samples_per_s

    variants: dict[str, Callable[[], float]] = {"compute_only": compute_only, "loader_only": loader_only,
                                                "trained": trained, "trained_auto": lambda: trained("auto")}
    cpu_only = device.type == "cpu"
    if cpu_only:
        variants |= {"compute_1_thread": lambda: compute_only(1), "loader_1_worker": lambda: loader_only(one_worker)}
    rates = interleave(variants, repeats=args.repeats)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    per_round = [t / min(c, ld) for t, c, ld in zip(rates["trained"], rates["compute_only"], rates["loader_only"],
                                                       strict=True)]
    efficiency = Spread.of(per_round)
    vs_auto = Spread.of(ratios(rates["trained"], rates["trained_auto"]))
    cores = available_cpus()
    report: dict[str, Any] = {"efficiency": efficiency.median, "efficiency_spread": efficiency.to_json(),
                              "goal": 0.97, "config": config.to_json(), "backend_source": args.backend,
                              "tuned_vs_auto": vs_auto.median, "tuned_vs_auto_spread": vs_auto.to_json(),
                              "kept_reason": tuned.kept_reason,
                              "samples_per_s": medians, "repeats": args.repeats, "cores": cores,
                              "hardware": hardware()}
    if cpu_only:
        limits = [cores * c1 * l1 / (c1 + l1) for c1, l1 in zip(rates["compute_1_thread"], rates["loader_1_worker"],
                                                                  strict=True)]
        vs_limit = Spread.of([t / limit for t, limit in zip(rates["trained"], limits, strict=True)])
        report |= {"cpu_limit_samples_per_s": statistics.median(limits),
                   "efficiency_vs_cpu_limit": vs_limit.median, "efficiency_vs_cpu_limit_spread": vs_limit.to_json()}
    print(describe(report["hardware"]))
    print(f"configuration   {config.label()} ({tuned.kept_reason})")
    for name in variants:
        print(f"{name:<16} {medians[name]:8.0f} samples/s")
    print(f"efficiency       {efficiency.median:.3f} (median of {args.repeats}, range "
          f"{efficiency.minimum:.3f}-{efficiency.maximum:.3f}) of min(compute alone, loader alone); goal >= 0.97 "
          "on an accelerator")
    print(f"tuned vs auto    {vs_auto.median:.3f}x trained (range {vs_auto.minimum:.3f}-{vs_auto.maximum:.3f}); "
          "goal >= 1")
    if cpu_only:
        print(f"CPU-work limit   {report['cpu_limit_samples_per_s']:8.0f} samples/s ({cores} cores x c1 x l1 / "
              f"(c1 + l1))")
        print(f"efficiency       {vs_limit.median:.3f} of the CPU-work limit (range {vs_limit.minimum:.3f}-"
              f"{vs_limit.maximum:.3f}); goal >= 0.97")
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
