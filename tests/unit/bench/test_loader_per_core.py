"""benchmarks/loader_per_core.py: its measuring function on a handful of images (seconds, not minutes)."""

from __future__ import annotations

import json
import os
import random
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from PIL import JpegImagePlugin

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from loader_per_core import _scale_name, draft_scales, measure, render, subset
from trainfast.atomic import write_json
from trainfast.data.images import ImageFolder


def test_measure_reports_both_pipelines_per_size_and_restores_the_process(tiny_images: Path, tmp_path: Path) -> None:
    affinity, threads, rng_state = os.sched_getaffinity(0), torch.get_num_threads(), random.getstate()
    report = measure(tiny_images / "train", sizes=(96, 48), images=12, repeats=2)
    assert os.sched_getaffinity(0) == affinity and torch.get_num_threads() == threads
    assert random.getstate() == rng_state
    assert report["images"] == 12 and report["ffcv_published_per_vcpu"] == 326
    assert report["cpu"] in affinity
    assert [row["image_size"] for row in report["sizes"]] == [96, 48]
    assert report["ratio"] == report["sizes"][0]["ratio"]
    for row in report["sizes"]:
        assert row["trainfast_per_core"] > 0 and row["torchvision_style_per_core"] > 0
        assert row["ratio_spread"]["n"] == 2 and row["trainfast_per_core_spread"]["n"] == 2
        assert sum(row["trainfast_draft_scales"].values()) == pytest.approx(1.0)
        assert row["goal_met"] == (row["ratio"] >= 1.5)
        assert row["trainfast_per_cpu_s"] > 0 and row["ratio_cpu_time"] > 0 and 0 < row["cpu_share"] <= 1.2
    text = render(report)
    assert "published figure (not measured here)" in text and "uint8" in text
    write_json(tmp_path / "r.json", report)
    assert json.loads((tmp_path / "r.json").read_text())["sizes"][1]["image_size"] == 48


def test_draft_census_matches_what_imagefolder_decodes(tiny_images: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The header-only replay of the crop draws predicts the DCT scale of every timed trainfast sample."""
    folder = ImageFolder(tiny_images / "train", image_size=112)
    indices = subset(len(folder), 30, seed=3)
    scales: Counter[str] = Counter()
    original = JpegImagePlugin.JpegImageFile.draft

    def spy(self: JpegImagePlugin.JpegImageFile, mode: str | None, size: tuple[int, int] | None) -> object:
        before = self.size[0]
        result = original(self, mode, size)
        scales[_scale_name(self.size[0] / before)] += 1
        return result

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    state = random.getstate()
    random.seed(3)
    try:
        for i in indices:
            folder[i]
    finally:
        random.setstate(state)
    monkeypatch.undo()
    census = draft_scales(folder, indices, seed=3)
    assert census == {k: v / len(indices) for k, v in scales.items()}
    assert len(census) > 1  # 112 px from 300-500 px images: some crops allow a 1/2-scale decode, some do not
