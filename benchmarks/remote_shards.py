"""Training from packed shards on an S3-compatible server with injected latency vs the same shards on local disk.

The quick demo dataset is packed once (`trainfast.pack`, at the training size) into a local folder, and the same
shards are uploaded to moto's S3-compatible server, started on localhost in a child process behind a middleware
that delays every request by --latency-ms (tests/remote_servers.py, the server the tests use). Then the same
training run (convnet, `make_loader(PackedImages(...), workers="auto")`, `Trainer`, fp32 without A/Bs so both
variants train alike) is timed on each: a warm-up run of each discarded, then --repeats interleaved rounds
(alternating order). Reported: the Trainer's samples/s and data-wait share of each, and the median of the per-round
ratios remote / local with their spread. Goal: remote >= 0.9x local.

The server runs on the same machine: its CPU time (moto answers each range request in Python) is taken from the
training's cores, as a real object store's would not be; the figure is a floor on such machines.

    python benchmarks/remote_shards.py --json remote_shards.json
    python benchmarks/remote_shards.py --repeats 3 --batches 10 --latency-ms 10
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import psutil

from trainfast import make_loader
from trainfast.atomic import write_json
from trainfast.bench.hardware import describe, hardware
from trainfast.bench.timing import Spread, interleave, ratios
from trainfast.data import PackedImages, build_model, ensure_demo_dataset, pack
from trainfast.data.packing import upload_pack
from trainfast.data.remote import ObjectStore
from trainfast.trainer.config import TrainConfig
from trainfast.trainer.loop import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from remote_servers import RemoteServer  # the tests' server, not part of the package

GOAL = 0.9


def train_rate(root: str | Path, args: argparse.Namespace, data_wait: list[float]) -> float:
    """One training run's samples/s (the Trainer's measured steps); its data-wait share goes to `data_wait`."""
    dataset = PackedImages(f"{root}/train", image_size=args.image_size)
    model = build_model("convnet", num_classes=len(dataset.classes), image_size=args.image_size)
    loader = make_loader(dataset, args.batch_size, shuffle=True, workers="auto", seed=0)
    config = TrainConfig(epochs=1, limit_batches=args.batches, progress=False, device="cpu", precision="32-true",
                         channels_last=False, warmup_steps=2)
    result = Trainer(model, config=config).fit(loader)
    data_wait.append(result.data_wait_fraction)
    return float(result.samples_per_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency-ms", type=float, default=10.0, help="delay of every request to the server")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=20, help="training batches per run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.getLogger("trainfast").setLevel(logging.WARNING)
    source = ensure_demo_dataset("quick")
    with tempfile.TemporaryDirectory() as tmp, RemoteServer("s3", latency_s=args.latency_ms / 1e3) as server:
        local = Path(tmp) / "packed"
        packed = pack(source, local, image_size=args.image_size, progress=False)
        os.environ.update(server.s3_env())  # fake credentials, the endpoint: as a real S3 is configured
        url = server.make_bucket("bench") + "/packed"
        upload_pack(local, ObjectStore(url, writable=True), packed, progress=False)
        waits: dict[str, list[float]] = {"local": [], "s3": []}
        server_cpu = psutil.Process(server.process.pid)
        cpu_s: list[float] = []

        def remote() -> float:  # and the server's CPU seconds, which the training's cores pay here
            before = sum(server_cpu.cpu_times()[:2])
            rate = train_rate(url, args, waits["s3"])
            cpu_s.append(sum(server_cpu.cpu_times()[:2]) - before)
            return rate

        server.command("reset")
        rates = interleave({"local": lambda: train_rate(local, args, waits["local"]), "s3": remote},
                           repeats=args.repeats)
        requests = server.requests()
    ratio = Spread.of(ratios(rates["s3"], rates["local"]))
    spreads = {k: Spread.of(v) for k, v in rates.items()}
    report: dict[str, Any] = {
        "ratio_s3_to_local": ratio.median, "ratio_spread": ratio.to_json(), "goal": GOAL,
        "local_samples_per_s": spreads["local"].to_json(), "s3_samples_per_s": spreads["s3"].to_json(),
        "data_wait": {k: Spread.of(v[1:]).to_json() for k, v in waits.items()},  # the warm-up run left out
        "latency_ms": args.latency_ms, "image_size": args.image_size, "batch_size": args.batch_size,
        "batches": args.batches, "repeats": args.repeats, "samples": packed.samples, "shards": packed.shards,
        "server_requests": requests, "server_cpu_s_per_run": Spread.of(cpu_s[1:]).to_json(),
        "hardware": hardware()}
    print(describe(report["hardware"]))
    for name in ("local", "s3"):
        wait = Spread.of(waits[name][1:]).median
        print(f"{name:6} {spreads[name].median:8.0f} samples/s (range {spreads[name].minimum:.0f}-"
              f"{spreads[name].maximum:.0f}), data wait {wait:.0%}")
    runs = args.repeats + 1
    print(f"the S3 server on this machine: {requests / runs:.0f} requests and {Spread.of(cpu_s[1:]).median:.1f} "
          f"CPU s per s3 run of {args.batches} batches")
    print(f"s3 with {args.latency_ms:g} ms per request / local disk: {ratio.median:.2f}x (median of {args.repeats} "
          f"interleaved rounds, range {ratio.minimum:.2f}-{ratio.maximum:.2f}); goal >= {GOAL}x")
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
