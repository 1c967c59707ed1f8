"""`trainfast tune`: measure loader/thread configurations on this machine and remember the best cheap one."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from trainfast.atomic import json_text, write_output
from trainfast.cli.flags import add_on_bad_sample_flag, data_root, open_data, positive_int
from trainfast.data.models import MODELS, build_model
from trainfast.data.packed import PackedImages
from trainfast.data.splits import describe_packed
from trainfast.data.synthetic import SIZES, ensure_demo_dataset
from trainfast.device import resolve_device
from trainfast.trainer.config import ConfigError
from trainfast.tune.step import training_step
from trainfast.tune.tuner import tune_loader

EXAMPLES = """examples:
  trainfast tune                                   # the demo dataset, batch 64, co-running the ConvNet's step
  trainfast tune --data ~/data/pets --batch-size 128 --budget-s 120 --json tune.json
  trainfast train --data ~/data/pets --batch-size 128 --workers tuned   # then use what it found
  trainfast tune --data ~/data/pets-packed --image-size 96 --batch-size 128   # a 'trainfast pack' output

--data DIR holds DIR/train/<class>/<image>, or is a folder written by 'trainfast pack' (DIR/train/index.json).
The result is cached per (dataset, batch size, machine) under $TRAINFAST_CACHE/tune and read by
make_loader(..., workers="tuned") and `trainfast train --workers tuned` with the same --data, --image-size and
--batch-size.
--on-bad-sample skip measures with corrupt images skipped (each logged), as `trainfast train --on-bad-sample skip`
reads them (packed data has none: 'pack' left them out). Errors are one line, 'trainfast tune: error: ...'
(--debug: the full traceback). Exit codes: 0 done, 1 the measurement failed (a corrupt image, a loader failure),
2 bad input (a value, the data folder, a dataset smaller than one batch).
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("tune", help="find the fastest cheap loader configuration by measurement", epilog=EXAMPLES,
                       description="Measure loader workers (processes or threads), prefetch, pinning and (on the CPU) "
                                   "intra-op threads while the real training step runs; keep the cheapest within 3% "
                                   "of the best, and only if it trains at least 3% faster than 'auto' in "
                                   "interleaved rounds.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=data_root, default=None,
                   help="image folder with train/, or a 'trainfast pack' output (a folder or its URL); default: the "
                        "demo dataset")
    p.add_argument("--demo-size", choices=tuple(SIZES), default="quick", help="demo dataset size without --data")
    p.add_argument("--batch-size", type=positive_int, default=64, help="samples per batch (default: 64)")
    p.add_argument("--image-size", type=positive_int, default=64, help="training resolution (default: 64)")
    p.add_argument("--model", choices=tuple(MODELS), default="convnet", help="model whose step co-runs")
    p.add_argument("--no-step", action="store_true", help="measure the loader alone (no training step)")
    p.add_argument("--budget-s", type=float, default=60.0, help="seconds the search may take (default: 60)")
    p.add_argument("--device", default="auto", help="'auto', 'cpu', 'cuda' or 'cuda:N' (default: auto)")
    add_on_bad_sample_flag(p)
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the result as JSON")
    p.set_defaults(run=run, command_parser=p)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.budget_s <= 0:
        parser.error(f"--budget-s {args.budget_s} is not valid; give a positive number of seconds")
    root = args.data if args.data else ensure_demo_dataset(args.demo_size)
    dataset, _ = open_data(root, parser, image_size=args.image_size, on_bad_sample=args.on_bad_sample, val=False)
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        parser.error(str(e))
    if len(dataset) < args.batch_size:  # every trial drops an incomplete batch: nothing would be measured
        raise ConfigError(f"--data {str(root)!r} has {len(dataset)} training image(s), fewer than one batch of "
                          f"--batch-size {args.batch_size}; give --batch-size {len(dataset)} or less, or more images")
    console = Console()
    if isinstance(dataset, PackedImages):
        console.print(f"data: {dataset.root}, packed by 'trainfast pack': {describe_packed(dataset)}",
                      markup=False, highlight=False, soft_wrap=True)
    step = None
    if not args.no_step:
        torch.manual_seed(0)
        model = build_model(args.model, num_classes=len(dataset.classes), image_size=args.image_size)
        step = training_step(model, normalize=dataset.normalize, device=device)
    result = tune_loader(dataset, args.batch_size, step, budget_s=args.budget_s, device=str(device))
    table = Table(title=f"trials ({'co-running the training step' if step else 'loader alone'})",
                  title_justify="left")
    table.add_column("configuration")
    table.add_column("", no_wrap=True)  # the mark, a column of its own: a long label wraps, the mark stays whole
    for column in ("samples/s", "vs baseline", "seconds"):
        table.add_column(column, justify="right")
    for trial in result.trials:
        table.add_row(trial.config.label(), "◀ chosen" if trial.config == result.chosen else "",
                      f"{trial.samples_per_s:,.0f}", f"{trial.samples_per_s / result.baseline_samples_per_s:.2f}x",
                      f"{trial.seconds:.1f}")
    console.print(table)
    # one line each, wrapped by the terminal: the label's length moves any break rich makes
    console.print(f"against auto: {result.kept_reason}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"chosen: {result.chosen.label()} — {result.chosen_samples_per_s:,.0f} samples/s, "
                  f"{result.speedup:.2f}x the baseline (workers=0, default threads); tuning took "
                  f"{result.sweep_seconds:.0f} s. Use it with --workers tuned / make_loader(..., workers='tuned').",
                  soft_wrap=True)
    if args.on_bad_sample == "skip":
        console.print(f"{dataset.skipped} corrupt sample(s) skipped while measuring", markup=False, highlight=False)
    if args.json:
        write_output(args.json, json_text(result.to_json()), what="the tuning result as JSON",
                     outcome="The tuning is done (its result is above); only this file is missing")
    return 0
