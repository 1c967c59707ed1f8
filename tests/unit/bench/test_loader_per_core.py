"""benchmarks/loader_per_core.py: its measuring function on a handful of images (seconds, not minutes)."""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, JpegImagePlugin

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from loader_per_core import (
    PackIndex,
    _scale_name,
    default_packed_dir,
    draft_scales,
    ensure_packed,
    measure,
    render,
    subset,
)
from trainfast.atomic import write_json
from trainfast.data.images import ImageFolder
from trainfast.data.packed import PackedImages


@pytest.fixture
def small_jpegs(tmp_path: Path) -> Path:
    """3 classes x 4 JPEGs of noise, each its own size (40-95 px): a source pack handles in well under a second."""
    rng = np.random.default_rng(0)
    root = tmp_path / "src"
    for c, name in enumerate(("ant", "bee", "cat")):
        (root / name).mkdir(parents=True)
        for i in range(4):
            w, h = 40 + 15 * i + 2 * c, 95 - 12 * i - c
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / name / f"{i:02d}.jpg")
    return root


def test_measure_reports_both_pipelines_per_size_and_restores_the_process(tiny_images: Path, tmp_path: Path) -> None:
    affinity, threads, rng_state = os.sched_getaffinity(0), torch.get_num_threads(), random.getstate()
    report = measure(tiny_images / "train", sizes=(96, 48), images=12, repeats=2)
    assert os.sched_getaffinity(0) == affinity and torch.get_num_threads() == threads
    assert random.getstate() == rng_state
    assert report["images"] == 12 and report["ffcv_published_per_vcpu"] == 326
    assert report["packed"] is None and report["pack_seconds"] is None and "packed" not in report["sizes"][0]
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


def test_packed_pipeline_is_packed_once_and_measured_beside_the_others(small_jpegs: Path, tmp_path: Path) -> None:
    dst = tmp_path / "packed"
    first = ensure_packed(small_jpegs, dst, max_size=64, progress=False)
    assert first.seconds is not None and first.seconds > 0  # packed by this call
    assert first.samples == first.source_files == 12 and first.skipped == 0 and first.max_size == 64
    assert first.bytes > 0 and first.source_bytes > 0
    report = measure(small_jpegs, sizes=(32,), images=8, repeats=2, packed=first)
    assert report["pack_seconds"] == first.seconds and report["packed"]["root"] == str(dst)
    assert report["packed"]["max_size"] == 64 and report["packed"]["quality"] == 90
    assert report["packed"]["bytes_vs_source"] == first.bytes / first.source_bytes
    assert report["packed_goal"] == 2.0 and report["packed_ratio"] == report["sizes"][0]["packed_ratio"]
    row = report["sizes"][0]
    assert row["packed_per_core"] > 0 and row["packed_per_core_spread"]["n"] == 2
    assert row["packed_ratio"] > 0 and row["packed_ratio_spread"]["n"] == 2
    assert row["packed_goal"] == 2.0 and row["packed_goal_met"] == (row["packed_ratio"] >= 2.0)
    assert row["packed_per_cpu_s"] > 0 and row["packed_vs_trainfast"] > 0
    assert sum(row["packed_draft_scales"].values()) == pytest.approx(1.0)
    assert row["ratio"] > 0 and row["goal_met"] == (row["ratio"] >= 1.5)  # the original fields are still there
    text = render(report)
    assert "packed" in text and "goal >= 2.0x" in text and "packed in" in text
    write_json(tmp_path / "r.json", report)
    assert json.loads((tmp_path / "r.json").read_text())["sizes"][0]["packed_goal"] == 2.0

    shards = {p: p.stat().st_mtime_ns for p in dst.glob("shard-*.tar")}
    again = ensure_packed(small_jpegs, dst, max_size=64, progress=False)
    assert again.seconds is None and again.samples == 12  # reused, nothing rewritten
    assert {p: p.stat().st_mtime_ns for p in dst.glob("shard-*.tar")} == shards
    reused = measure(small_jpegs, sizes=(32,), images=4, repeats=1, packed=again)
    assert reused["pack_seconds"] is None and "reused from an earlier run" in render(reused)

    other = ensure_packed(small_jpegs, dst, max_size=48, progress=False)  # other settings: packed again, in place
    assert other.seconds is not None and PackedImages(dst).settings["max_size"] == 48
    copy = shutil.copytree(small_jpegs, tmp_path / "copy")  # the same file list and settings, another source
    assert ensure_packed(copy, dst, max_size=48, progress=False).seconds is not None
    assert default_packed_dir(small_jpegs, 48) != default_packed_dir(small_jpegs, 64)
    assert default_packed_dir(small_jpegs, 64) != default_packed_dir(tmp_path / "elsewhere" / "src", 64)


def test_pack_index_maps_each_source_file_to_its_packed_sample_across_a_gap(small_jpegs: Path, tmp_path: Path) -> None:
    """A corrupt source file is left out of the pack: later samples shift down one, and the mapping follows."""
    (small_jpegs / "bee" / "01b.jpg").write_bytes(b"not a jpeg")  # between bee/01 and bee/02
    packed = ensure_packed(small_jpegs, tmp_path / "packed", max_size=256, progress=False)
    assert packed.skipped == 1 and packed.samples == 12 and packed.source_files == 13
    folder = ImageFolder(small_jpegs, image_size=32, train=False)
    bad = [i for i in range(len(folder)) if folder.path(i).endswith("01b.jpg")]
    good = [i for i in range(len(folder)) if i not in bad]
    index = PackIndex(packed.root)
    positions = index.positions(folder, good)
    assert positions == list(range(12)) and positions[-1] == good[-1] - 1  # the gap: index i is not file i after it
    samples = PackedImages(packed.root, image_size=32, train=False)
    for i, j in zip(good, positions, strict=True):  # small JPEGs are kept byte for byte: the same pixels
        image, label = folder[i]
        packed_image, packed_label = samples[j]
        assert torch.equal(image, packed_image) and label == packed_label
    with pytest.raises(ValueError, match="left out 1"):
        index.positions(folder, bad)
