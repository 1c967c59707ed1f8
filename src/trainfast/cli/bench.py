"""`trainfast bench`: the before/after tables (loader workers; precision x batch size; naive vs trainfast) on this
machine."""

from __future__ import annotations

import argparse
import shlex
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from trainfast.atomic import json_text, write_output
from trainfast.bench.sweeps import FULL_BENCH, QUICK_BENCH, run_bench, worker_counts
from trainfast.bench.tables import render, to_markdown
from trainfast.cli.flags import check_data_root, positive_int
from trainfast.data.packed import PackedImages
from trainfast.data.splits import ImageData, describe_packed, open_split
from trainfast.data.synthetic import ensure_demo_dataset
from trainfast.host import available_cpus
from trainfast.trainer.clock import WARMUP_STEPS

EXAMPLES = """examples:
  trainfast bench --quick                                   # about 1-2 minutes on 2 CPU cores
  trainfast bench --json bench.json --markdown bench.md --plot bench.png
  trainfast bench --data ~/data/pets --quick --plot pets.png   # your own <root>/train/<class>/<image>
  trainfast bench --data ~/data/pets-packed --quick            # a folder written by 'trainfast pack'
  trainfast bench --quick --steps 6                         # fewer steps a row: sooner, noisier figures

Three measurements, each row printed as it finishes:
  workers    the reference ConvNet (64 px, batch 64; fp32 on the CPU, precision 'auto' on CUDA) trained by
             trainfast's Trainer for the same number of batches at num_workers 0..usable CPUs: epoch time,
             samples/s, data wait and device utilisation (GPU util on CUDA, mean CPU % otherwise)
  precision  fp32 vs mixed precision (bf16-mixed; 16-mixed on pre-Ampere GPUs) at batch 64, 128, 256 on
             in-memory synthetic images (compute only): peak memory, samples/s; out-of-memory rows say OOM
  naive vs trainfast   'trainfast demo's two runs on the same data (needs val/ and at most 10 classes); on a
             'trainfast pack' output both read the shards, the naive run decoding in full in the main process

--plot needs matplotlib (pip install trainfast[plot]). The demo dataset is generated on first use under
$TRAINFAST_CACHE (default ~/.cache/trainfast). A corrupt image stops the bench naming the file (a benchmark
does not skip samples: there is no --on-bad-sample here). Errors are one line, 'trainfast bench: error: ...'
(--debug: the full traceback). Exit codes: 0 done, 1 a measurement failed (a corrupt image, a loader failure)
or a report file could not be written (a full volume: the tables are printed first), 2 bad input.
"""


# A report file that cannot be written (a full volume) costs the file, not the measurements: they are printed above
DONE = "The benchmark ran (its tables are above); only this file is missing"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="before/after tables (workers, precision x batch, naive vs trainfast) here",
                       description="Measure the tutorials' before/after tables on this machine: loader workers, "
                                   "precision x batch size, and naive vs trainfast.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="the small demo dataset and fewer steps per row (under 3 minutes on 2 cores)")
    p.add_argument("--data", type=Path, default=None, metavar="DIR",
                   help="image folder with train/<class>/<image> (val/ optional), or a 'trainfast pack' output; "
                        "default: the demo dataset")
    p.add_argument("--steps", type=positive_int, default=None, metavar="N",
                   help=f"steps per row of the workers and precision tables, the first {WARMUP_STEPS} untimed "
                        "(default: 20 and 12 with --quick, 60 and 30 without); more steps, steadier figures")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the report as JSON")
    p.add_argument("--plot", type=Path, default=None, metavar="PATH", help="write a PNG of the report (matplotlib)")
    p.add_argument("--markdown", type=Path, default=None, metavar="PATH",
                   help="write the tables as GitHub markdown, with the machine and the command")
    p.set_defaults(run=run, command_parser=p)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    for flag, example in (("json", "bench.json"), ("plot", "bench.png"), ("markdown", "bench.md")):
        path = getattr(args, flag)  # refused now, not after minutes of measuring
        if path is not None and path.is_dir():
            parser.error(f"--{flag} {str(path)!r} is a folder; give a file path such as {example}")
    if args.plot is not None:
        from trainfast.bench.plot import PlotUnavailableError, require_matplotlib
        try:
            require_matplotlib()
        except PlotUnavailableError as e:
            parser.error(str(e))
    spec = QUICK_BENCH if args.quick else FULL_BENCH
    if args.steps is not None:
        if args.steps <= WARMUP_STEPS:
            parser.error(f"--steps {args.steps} leaves no step to time: the first {WARMUP_STEPS} of each row are "
                         f"warm-up; give {WARMUP_STEPS + 1} or more")
        spec = replace(spec, worker_batches=args.steps, precision_steps=args.steps)
    console = Console()
    if args.data is not None:
        root = args.data.expanduser()
        train = _check_data(root, parser)
        if isinstance(train, PackedImages):
            console.print(f"data: {root}, packed by 'trainfast pack': {describe_packed(train)}; the workers rows "
                          "and both naive vs trainfast runs read the packed shards (the naive run decodes them in "
                          "full, in the main process)", markup=False, highlight=False, soft_wrap=True)
    else:
        started = time.perf_counter()
        try:
            root = ensure_demo_dataset(spec.demo.dataset, seed=spec.seed)
        except (OSError, ValueError) as e:
            parser.error(str(e))
        console.print(f"demo dataset: {root} (generated or cached in {time.perf_counter() - started:.1f} s)",
                      markup=False, highlight=False)
    command = shlex.join(["trainfast", "bench", *(["--quick"] if args.quick else []),
                          *(["--data", str(args.data)] if args.data is not None else []),
                          *(["--steps", str(args.steps)] if args.steps is not None else [])])
    workers = list(spec.workers) if spec.workers is not None else worker_counts(available_cpus())
    console.print(f"measuring: num_workers {workers[0]}..{workers[-1]} ({len(workers)} rows of "
                  f"{spec.worker_batches} batches), {2 * len(spec.batch_multipliers)} precision rows of "
                  f"{spec.precision_steps} steps, then naive vs trainfast; a line per row",
                  markup=False, highlight=False)

    def progress(line: str) -> None:
        console.print(f"  {line}", markup=False, highlight=False)

    report = run_bench(spec, root, progress=progress, command=command)
    render(report, console)
    if args.json is not None:
        write_output(args.json, json_text(report), what="the benchmark's JSON", outcome=DONE)
        console.print(f"wrote {args.json}", markup=False, highlight=False)
    if args.markdown is not None:
        write_output(args.markdown, to_markdown(report), what="the benchmark's Markdown", outcome=DONE)
        console.print(f"wrote {args.markdown}", markup=False, highlight=False)
    if args.plot is not None:
        from trainfast.bench.plot import plot_png
        write_output(args.plot, plot_png(report), what="the benchmark's plot", outcome=DONE)
        console.print(f"wrote {args.plot}", markup=False, highlight=False)
    return 0


def _check_data(root: Path, parser: argparse.ArgumentParser) -> ImageData:
    """ROOT's training set (an image folder or a 'trainfast pack' output), or exit 2 naming what is wrong."""
    check_data_root(root, parser)
    try:
        return open_split(root, "train")
    except (FileNotFoundError, ValueError) as e:
        parser.error(f"--data {str(root)!r}: {e}")
