"""Reads that wait: does `make_loader(workers="auto")` hide 20 ms of storage latency per sample by itself?

Two variants train the demo's ConvNet (64 px, batch 32, everything "auto": precision, channels_last, cpu_threads)
with trainfast's `Trainer`, fed by `make_loader(dataset, 32, workers="auto")` and nothing else set:

  no latency   the quick demo's JPEGs (`ImageFolder`, draft decode, random crops and flips), as on a local disk
  20 ms reads  the same dataset, each `__getitem__` first sleeping 20 ms: the first-byte latency of NFS or an
               object store (a sleep, so that the figure does not depend on a network), then the same decode

Today's "auto" would give both one worker process on 2 CPUs: 32 x 20 ms = 0.64 s of waiting per batch, ~50
samples/s. Goal: the 20 ms variant at >= 0.8x the no-latency rate. One warm-up run of each, then `--repeats`
rounds alternating their order; reported: median samples/s of each with its spread, the median per-round ratio,
what each loader chose, and the CPU.

    python benchmarks/read_latency.py --json read_latency.json
    python benchmarks/read_latency.py --repeats 3 --epochs 1 --latency-ms 50
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset

from trainfast.atomic import write_json
from trainfast.bench.hardware import describe, hardware
from trainfast.bench.timing import Spread, interleave, ratios
from trainfast.data.images import ImageFolder
from trainfast.data.models import build_model
from trainfast.data.synthetic import ensure_demo_dataset
from trainfast.loader import ThreadLoader, make_loader
from trainfast.loader.seeding import seed_all
from trainfast.trainer.config import TrainConfig
from trainfast.trainer.loop import Trainer

GOAL = 0.8  # 20 ms reads / no latency
BATCH = 32
IMAGE_SIZE = 64


class Delayed(Dataset[Any]):
    """`dataset`'s samples, each read first waiting `latency_s` (a storage round-trip; the CPU idles meanwhile)."""

    def __init__(self, dataset: ImageFolder, latency_s: float) -> None:
        self.dataset, self.latency_s = dataset, latency_s
        self.normalize = dataset.normalize  # as make_loader finds it on the dataset itself

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        time.sleep(self.latency_s)
        return self.dataset[i]


def train(dataset: Dataset[Any], epochs: int, chosen: dict[str, Any], name: str) -> float:
    """Samples/s of `epochs` epochs of the ConvNet on `dataset` (the Trainer's own figure: training steps only)."""
    seed_all(0)
    model = build_model("convnet", num_classes=10, image_size=IMAGE_SIZE)
    loader = make_loader(dataset, BATCH, workers="auto", seed=0, device="cpu")
    config = TrainConfig(epochs=epochs, warmup_steps=10, seed=0, cpu_threads="auto", progress=False, device="cpu")
    result = Trainer(model, config=config).fit(loader)
    plan = loader.plan
    assert plan is not None  # make_loader's loaders always carry their plan
    stats = loader.fetch_stats if isinstance(loader, ThreadLoader) else None
    chosen.setdefault(name, []).append({
        "backend": plan.backend, "workers": plan.num_workers, "loader_cores": plan.loader_cores,
        "threads_at_end": stats.threads if stats else None, "fetch_busy": stats.busy if stats else None,
        "data_wait_fraction": result.data_wait_fraction})
    return float(result.samples_per_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=2, help="epochs of the quick demo's 1,600 images per run")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.getLogger("trainfast").setLevel(logging.WARNING)
    root = ensure_demo_dataset("quick", seed=0)
    images = ImageFolder(root / "train", image_size=IMAGE_SIZE)
    delayed = Delayed(images, args.latency_ms / 1000)
    latency = f"{args.latency_ms:g} ms reads"
    chosen: dict[str, list[dict[str, Any]]] = {}

    def variant(name: str, dataset: Dataset[Any]) -> Callable[[], float]:
        return lambda: train(dataset, args.epochs, chosen, name)

    rates = interleave({"no latency": variant("no latency", images), latency: variant(latency, delayed)},
                       repeats=args.repeats)
    ratio = Spread.of(ratios(rates[latency], rates["no latency"]))
    hw = hardware()
    print(f"{describe(hw)}; ConvNet {IMAGE_SIZE} px, batch {BATCH}, {args.epochs} epoch(s) of {len(images)} images, "
          f"median of {args.repeats} interleaved rounds after a warm-up")
    for name, values in rates.items():
        s = Spread.of(values)
        last = chosen[name][-1]
        threads = f", {last['threads_at_end']} at the end, fetch busy {last['fetch_busy']:.0%}" \
            if last["threads_at_end"] is not None else ""
        print(f"  {name:<14} {s.median:7.0f} samples/s (p25-p75 {s.low:.0f}-{s.high:.0f}, range {s.minimum:.0f}-"
              f"{s.maximum:.0f}); {last['workers']} {last['backend']} worker(s){threads}; data wait "
              f"{last['data_wait_fraction']:.0%}")
    verdict = "reached" if ratio.median >= GOAL else "NOT reached"
    print(f"  ratio {ratio.median:.2f}x (range {ratio.minimum:.2f}-{ratio.maximum:.2f}); goal >= {GOAL}x {verdict}")
    if args.json:
        write_json(args.json, {
            "samples_per_s": {name: Spread.of(values).to_json() for name, values in rates.items()},
            "rounds": rates, "ratio": ratio.to_json(), "goal": GOAL, "chosen": chosen,
            "setup": {"model": "convnet", "image_size": IMAGE_SIZE, "batch_size": BATCH, "epochs": args.epochs,
                      "latency_ms": args.latency_ms, "images": len(images), "repeats": args.repeats,
                      "torch_threads_before": torch.get_num_threads()},
            "hardware": hw})


if __name__ == "__main__":
    main()
