"""`trainfast pack SRC DST`: an image folder as pre-sized JPEG tar shards that `trainfast train --data DST` reads."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from trainfast.cli.flags import data_root, positive_int
from trainfast.data.packing import DEFAULT_MAX_SIZE, PackWriteError, pack
from trainfast.trainer.config import ConfigError
from trainfast.units import format_bytes, to_bytes

EXAMPLES = """examples:
  trainfast pack ~/data/pets ~/data/pets-packed --image-size 96   # shorter side 110 px (1.15 x 96)
  trainfast train --data ~/data/pets-packed --image-size 96 --epochs 10
  trainfast pack ~/data/imagenet /fast/imagenet-256 --max-size 256 --quality 90 --shard-bytes 256MiB
  trainfast pack ~/data/pets s3://bucket/pets-packed --image-size 96   # then: train --data s3://bucket/pets-packed

SRC holds SRC/<class>/<image>, or SRC/train/<class>/<image> and SRC/val/<class>/<image> (packed into DST/train
and DST/val). DST gets shard-000000.tar, ... (WebDataset layout: <key>.jpg and <key>.cls per sample) and
index.json. A corrupt source image is logged, left out and listed in index.json. Rerunning the same command
after an interruption keeps the finished shards and writes the missing ones. A full volume (or a folder that
refuses writes) ends it with one message and exit 1: the file, the bytes needed and free, the shards kept.
DST may be s3://bucket/prefix (pip install 'trainfast[remote]'; credentials from the usual AWS sources, another
S3-compatible server with AWS_ENDPOINT_URL=http://host:port): the pack is made in a staging folder under the
trainfast cache, then uploaded shard by shard, index.json last; a rerun uploads only what is missing. Failed
requests are retried for up to $TRAINFAST_REMOTE_RETRY_S seconds (30). http(s):// is read-only.
"""


def byte_size(text: str) -> int:
    """`65536`, `64MiB`, `500MB`, `1GiB` as bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    size = to_bytes(float(match.group(1)), match.group(2)) if match else None
    if size is None or size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; give bytes, e.g. 67108864, 64MiB or 500MB")
    return size


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("pack", help="write an image folder as pre-sized JPEG tar shards for fast reading",
                       description="Write SRC's images as JPEG tar shards (WebDataset layout) with an index, "
                                   "resized so the shorter side is at most --max-size.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path, metavar="SRC", help="image folder: SRC/<class>/<image> or SRC/train, SRC/val")
    p.add_argument("dst", type=data_root, metavar="DST",
                   help="output folder for the shards and index.json, or s3://bucket/prefix")
    p.add_argument("--max-size", type=positive_int, default=None, metavar="PX",
                   help=f"shorter side at most PX pixels, never upscaled (default: 1.15 x --image-size, else "
                        f"{DEFAULT_MAX_SIZE})")
    p.add_argument("--quality", type=int, default=90, metavar="Q", help="JPEG quality 1-100 (default: 90)")
    p.add_argument("--shard-bytes", type=byte_size, default="64MiB", metavar="N",
                   help="target shard size: bytes or 64MiB, 500MB (default: 64MiB)")
    p.add_argument("--image-size", type=positive_int, default=None, metavar="PX",
                   help="the training resolution, to size --max-size from")
    p.add_argument("--workers", type=positive_int, default=None, metavar="N",
                   help="processes writing shards (default: the usable CPUs)")
    p.set_defaults(run=run, command_parser=p)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        result = pack(args.src.expanduser(), args.dst, max_size=args.max_size, quality=args.quality,
                      shard_bytes=args.shard_bytes, workers=args.workers, image_size=args.image_size)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        raise ConfigError(str(e)) from e
    except PackWriteError as e:  # the work failed, not the input: exit 1, and the shards written are kept
        if getattr(args, "debug", False):
            raise
        print(f"{parser.prog}: error: {e}", file=sys.stderr, flush=True)
        return 1
    for name, split in (result.splits or {"": result}).items():
        where = f"{split.root}" + (f" ({name})" if name else "")
        print(f"packed {split.samples:,} images into {split.shards} shard(s), {format_bytes(split.bytes)}, at "
              f"{where}: {split.shards_written} written, {split.shards_kept} kept from an earlier run, "
              f"{len(split.skipped)} corrupt image(s) skipped"
              + (f"; {split.shards_uploaded} uploaded, {split.shards - split.shards_uploaded} already there"
                 if isinstance(split.root, str) else ""))
    print(f"done in {result.seconds:.1f} s; train with: trainfast train --data {result.root}")
    return 0
