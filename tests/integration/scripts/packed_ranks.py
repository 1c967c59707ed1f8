"""One epoch over packed shards on every rank of a gloo process group (run by torchrun); rank 0 writes the
sample indices each rank was given, for tests/integration/test_packed_ddp.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch.distributed as dist

from trainfast import PackedImages, make_loader


class Indexed(PackedImages):
    """PackedImages that also returns each sample's index."""

    def __getitem__(self, index: int) -> Any:
        image, label = super().__getitem__(index)
        return image, label, index


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        loader = make_loader(Indexed(args.data, image_size=16, train=True), 4, drop_last=False, workers=1, seed=0)
        seen: list[int] = []
        for _, _, indices in loader:  # rank and world size from torchrun's RANK / WORLD_SIZE
            seen.extend(int(i) for i in indices)
        per_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, seen)
        if dist.get_rank() == 0:
            Path(args.out).write_text(json.dumps({"samples": len(loader.dataset), "per_rank": per_rank}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
