"""Packed shards under 2 gloo ranks: each rank reads its own samples, and one epoch covers every sample exactly
once (an even count: no wrap-around padding)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from trainfast import pack

SCRIPT = Path(__file__).parent / "scripts" / "packed_ranks.py"
ENV = os.environ | {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_two_ranks_cover_every_packed_sample_exactly_once(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (tmp_path / "src" / c).mkdir(parents=True)
        for i in range(11):
            Image.fromarray(rng.integers(0, 255, (24, 30, 3), dtype=np.uint8)).save(tmp_path / "src" / c / f"{i}.jpg")
    result = pack(tmp_path / "src", tmp_path / "packed", shard_bytes=4096, workers=1, progress=False)
    assert result.samples == 22 and result.shards >= 2
    out = tmp_path / "ranks.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(SCRIPT), "--data", str(tmp_path / "packed"), "--out", str(out)],
                          env=ENV, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    first, second = (sorted(r) for r in report["per_rank"])
    assert len(first) == len(second) == 11
    assert not set(first) & set(second)  # no overlap
    assert sorted(first + second) == list(range(report["samples"]))  # every sample, once
