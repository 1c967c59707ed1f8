"""`trainfast train`: train a reference model on an image folder (the demo dataset by default)."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path
from typing import Any

from trainfast.atomic import OutputWriteError, json_text, write_output
from trainfast.cli.flags import (
    add_config_flags,
    add_on_bad_sample_flag,
    config_values,
    data_root,
    open_data,
    positive_int,
    workers_arg,
)
from trainfast.data.models import MODELS, build_model
from trainfast.data.synthetic import SIZES, ensure_demo_dataset
from trainfast.launch import launch_env
from trainfast.loader.auto import Auto, LoaderPlan
from trainfast.loader.make import make_loader
from trainfast.loader.options import Tuned
from trainfast.loader.seeding import seed_all
from trainfast.trainer.config import ConfigError, TrainConfig
from trainfast.trainer.loop import Trainer
from trainfast.trainer.phases import summary_line

log = logging.getLogger("trainfast")
EXAMPLES = """examples:
  trainfast train --epochs 2 --limit-batches 20            # demo dataset, quick size
  trainfast train --data ~/data/pets --model convnet --image-size 96 --epochs 10 --checkpoint-dir runs/pets
  trainfast train --checkpoint-dir runs/pets --resume      # continue after a stop or preemption
  trainfast train --epochs 3 --compile auto --json run.json # torch.compile kept only if it pays here
  trainfast train --epochs 3 --tensorboard runs/tb         # then: tensorboard --logdir runs/tb
  torchrun --standalone --nproc-per-node=2 -m trainfast train --epochs 2 --checkpoint-dir runs/ddp --resume
  torchrun --standalone --nproc-per-node=2 -m trainfast train --strategy fsdp --checkpoint-dir runs/fsdp --resume

--data DIR must hold DIR/train/<class>/<image> (and optionally DIR/val/<class>/<image>), or be a folder written
by 'trainfast pack' (DIR/train/index.json and optionally DIR/val/index.json: fewer, larger files to read).
--data may be the URL of a packed folder, s3://bucket/prefix or http(s)://host/prefix (pip install
'trainfast[remote]'): each batch's samples are fetched by byte range at once; a request that fails is retried for
up to $TRAINFAST_REMOTE_RETRY_S seconds (30), then the run stops with one line and its checkpoints intact.
S3 credentials come from the usual AWS sources; another S3-compatible server with AWS_ENDPOINT_URL=http://host:port.
precision, channels_last and --compile auto are confirmed by A/Bs on the first steps: the log and the JSON's
precision / channels_last / compile blocks say what was chosen, with the measured step times.
Each epoch's checkpoint is written in the background while the next epoch trains (training waits only to copy the
state to host memory); the summary and the JSON's checkpoint_blocked_s / checkpoint_write_s say how long.
Under torchrun --strategy auto keeps DDP while the model, its gradients and AdamW's state fit the device with room,
else shards them (FSDP; checkpoints are then folders, last.dcp, written by every rank); the log says which and why.
The last line accounts for the run's wall time (training's own, from its set-up to its end) in the phases of
'trainfast doctor --whole-run': goodput is the training steps' share; the JSON's whole_run has wall_s, goodput and
phases (phase, seconds, share: startup, compile, train, evaluation, checkpoint, epoch_start, other).
--on-bad-sample skip: a corrupt or truncated image is logged and replaced by the next one (at most 1% of the
samples); the summary and the JSON's skipped_samples count them.
Errors are one line, 'trainfast train: error: ...' (--debug: the full traceback). Exit codes: 0 done,
1 training failed (a non-finite loss, out of memory, a corrupt image, a loader failure, or no room to write
last.pt: the message names the checkpoint to resume from; or to write --json), 2 bad input (a value, the data
folder, a dataset smaller than one batch, a checkpoint that cannot be resumed), 143 stopped by SIGTERM (checkpoint
saved).
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("train", help="train a model with every speed practice on",
                       description="Train a reference model on an image folder (the demo dataset by default).",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=data_root, default=None,
                   help="image folder with train/ (and val/), or a 'trainfast pack' output (a folder or its s3:// or "
                        "http(s):// URL); default: the demo dataset")
    p.add_argument("--demo-size", choices=tuple(SIZES), default="quick", help="demo dataset size when --data is absent")
    p.add_argument("--model", choices=tuple(MODELS), default="convnet", help="reference model (default: convnet)")
    p.add_argument("--image-size", type=positive_int, default=64, help="training resolution in pixels (default: 64)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="samples per batch (default: 64)")
    p.add_argument("--workers", type=workers_arg, default="auto",
                   help="loader workers: 'auto', N, or 'tuned' (`trainfast tune`'s result for the training data, "
                        "'auto' without one) (default: auto)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest good checkpoint in --checkpoint-dir (last.pt, or last.dcp written "
                        "under --strategy fsdp, at any world size) if there is one")
    add_on_bad_sample_flag(p)
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the result as JSON")
    add_config_flags(p, TrainConfig, defaults={"cpu_threads": "auto", "seed": 0})
    p.set_defaults(run=run, command_parser=p)


def validation_workers(workers: int | Auto | Tuned, plan: LoaderPlan | None, samples: int, batch_size: int,
                       world_size: int) -> dict[str, Any]:
    """`make_loader`'s workers and backend for the validation loader: `--workers N` as given; for "auto" and
    "tuned", the training loader's workers and backend (`trainfast tune` tunes the training loader only), at most
    one per validation batch. The Trainer iterates validation every epoch, so its workers persist: each pass neither
    restarts them nor waits for its first batches, made ahead during training. make_loader's own "auto" would give
    a validation set under its one-pass threshold no worker and decode it in the main process (measured on the quick
    demo, 3 epochs on 2 CPUs: 0.40-0.43 s per pass of 7 batches with none; with one persistent worker 0.38 s for the
    first, which starts it, and 0.13-0.15 s for the others, whose first batches were made during training)."""
    if workers not in ("auto", "tuned"):
        return {"workers": workers}
    if plan is None:  # a loader without a plan to follow
        return {"workers": "auto"}
    batches = math.ceil(math.ceil(samples / world_size) / batch_size)
    chosen = min(plan.num_workers, max(1, batches))
    log.info("validation loader: %d %s of the training loader's plan (the Trainer validates every epoch: %s)",
             chosen, "thread(s)" if plan.backend == "threads" else "worker(s)",
             "kept between epochs" if chosen else "none to keep")
    return {"workers": chosen, "backend": plan.backend}


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        launch = launch_env()  # torchrun's rank and world size, or a single process
        config = TrainConfig(**config_values(args, TrainConfig))
    except ValueError as e:
        parser.error(str(e))
    if not launch.is_main:  # under torchrun, one rank speaks
        log.setLevel(max(log.level, logging.WARNING))
    if args.resume and not config.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir DIR (where last.pt is kept)")
    root = args.data if args.data else ensure_demo_dataset(args.demo_size)
    train_set, val_set = open_data(root, parser, image_size=args.image_size, on_bad_sample=args.on_bad_sample)
    if val_set is None:
        log.warning("no %s/val folder: training without validation (and without best.pt)", root)
    seed = 0 if config.seed is None else config.seed
    seed_all(seed)  # weight init; data order and augmentation use the loader's seed
    model = build_model(args.model, num_classes=len(train_set.classes), image_size=args.image_size)
    # trainfast's own errors from here on (a non-finite loss, out of memory, no room for a checkpoint, a corrupt
    # image, a checkpoint that cannot be resumed) become one line and exit 1 or 2 in trainfast.cli.main
    train_loader = make_loader(train_set, args.batch_size, shuffle=True, workers=args.workers,
                               device=config.device, seed=seed)
    if len(train_loader) == 0:  # the Trainer would refuse it too, without naming the flag
        world = launch.world_size
        per_rank = math.ceil(len(train_set) / world)
        ranks = f" ({per_rank} per rank of {world})" if world > 1 else ""
        raise ConfigError(f"--data {str(root)!r} has {len(train_set)} training image(s){ranks}, fewer than one batch "
                          f"of --batch-size {args.batch_size} (training drops an incomplete batch); give "
                          f"--batch-size {per_rank} or less, or more images")
    val_loader = (make_loader(val_set, args.batch_size, shuffle=False, device=config.device,
                              **validation_workers(args.workers, train_loader.plan, len(val_set), args.batch_size,
                                                   launch.world_size))
                  if val_set is not None else None)
    trainer = Trainer(model, config=config)
    result = trainer.fit(train_loader, val_loader, resume=args.resume)
    skipped = train_set.skipped + (val_set.skipped if val_set is not None else 0)
    summary = result.to_json() | {"skipped_samples": skipped}
    loss = f"{result.final_loss:.4f}" if result.final_loss is not None else "n/a"
    accuracy = f"{result.val_accuracy:.1%}" if result.val_accuracy is not None else "n/a"
    if not launch.is_main:
        return 0
    print(f"trained {result.epochs} epoch(s), {result.steps} steps: {result.samples_per_s:,.0f} samples/s, "
          f"data wait {result.data_wait_fraction:.0%}, final loss {loss}, val accuracy {accuracy}"
          + (f", {skipped} corrupt sample(s) skipped" if args.on_bad_sample == "skip" else ""))
    if result.checkpoint:
        print(f"checkpoints: {result.checkpoint}" + (f", {result.best_checkpoint}" if result.best_checkpoint else ""))
    if result.checkpoint_blocked_s:
        blocked, written = result.checkpoint_blocked_s, result.checkpoint_write_s
        print(f"checkpoint saves: training waited {sum(blocked):.3f} s for {len(blocked)} save(s) (at most "
              f"{max(blocked):.3f} s each); their writes took {sum(written):.3f} s in the background")
    if result.whole_run is not None:
        print(summary_line(result.whole_run))
    if args.json:
        try:  # a full volume costs the summary file, not the run: the checkpoints are written already
            kept = f" ({result.checkpoint} is intact)" if result.checkpoint else ""
            write_output(args.json, json_text(summary), what="the JSON summary",
                         outcome=f"Training finished{kept}; only this file is missing")
        except OutputWriteError as e:
            if getattr(args, "debug", False):
                raise
            print(f"{parser.prog}: error: {e}", file=sys.stderr, flush=True)
            return 1
    return 0
