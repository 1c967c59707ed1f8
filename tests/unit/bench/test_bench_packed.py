"""`trainfast bench --data DIR` on a folder written by `trainfast pack`: the workers rows and both naive vs trainfast
runs read the packed shards (the naive run with a full decode, in the main process), and the printed output, the
tables and the JSON say so."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import helpers
from trainfast.bench import demo, sweeps
from trainfast.bench.demo import QUICK
from trainfast.bench.sweeps import BenchSpec, measure_naive_vs_trainfast, measure_workers
from trainfast.bench.tables import versus_line
from trainfast.cli import bench as bench_cli
from trainfast.cli import main
from trainfast.data import PackedImages
from trainfast.data.splits import ImageData

pytestmark = pytest.mark.timeout(120)

CPU = torch.device("cpu")
SPEC = replace(QUICK, epochs=1, batch_size=8, image_size=16)
TINY_BENCH = BenchSpec(demo=SPEC, batch_size=8, image_size=16, worker_batches=2, precision_steps=2,
                       batch_multipliers=(1,), workers=(0,))


def make_packed(tmp_path: Path, *, val: bool = True) -> Path:
    """tmp_path/packed/train (2 classes x 8 images, 40-47 x 30 px) and, with `val`, tmp_path/packed/val (2 x 4)."""
    return helpers.make_packed(tmp_path, train=8, val=4 if val else 0, size=(40, 30))


def test_both_runs_read_the_packed_shards_the_naive_one_in_full(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    root = make_packed(tmp_path)
    opened: list[tuple[str, str, bool, str]] = []
    real = demo.open_split

    def spy(root: Path, split: str = "train", **kwargs: Any) -> ImageData:
        dataset = real(root, split, **kwargs)
        opened.append((split, type(dataset).__name__, dataset.train, dataset.decode))
        return dataset

    monkeypatch.setattr(demo, "open_split", spy)
    lines: list[str] = []
    versus = measure_naive_vs_trainfast(SPEC, root, progress=lines.append)
    assert versus["naive"]["steps"] == versus["trainfast"]["steps"] == 16 // 8
    assert versus["reads"] == {"naive": {"format": "packed", "decode": "full", "workers": 0},
                               "trainfast": {"format": "packed", "decode": "draft", "workers": "auto"}}
    assert opened == [("train", "PackedImages", True, "full"), ("val", "PackedImages", False, "full"),
                      ("train", "PackedImages", True, "draft"), ("val", "PackedImages", False, "draft")]
    assert "both reading the packed shards" in lines[0]
    report = {"naive_vs_trainfast": versus}
    assert "; both read the packed shards ('trainfast pack'), the naive run decoding them in full" in \
        versus_line(report)


def test_without_a_packed_val_split_the_comparison_is_skipped(tmp_path: Path) -> None:
    root = make_packed(tmp_path, val=False)
    assert measure_naive_vs_trainfast(SPEC, root) == {
        "skipped": f"no {root / 'val' / 'index.json'}: the demo's runs validate at the end of each epoch"}


def test_workers_rows_read_the_packed_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make_packed(tmp_path)
    seen: list[object] = []
    real = sweeps.make_loader

    def spy(dataset: object, *args: Any, **kwargs: Any) -> Any:
        seen.append(dataset)
        return real(dataset, *args, **kwargs)

    monkeypatch.setattr(sweeps, "make_loader", spy)
    rows = measure_workers(root, workers=[0], batch_size=8, image_size=16, limit_batches=2, device=CPU)
    assert rows[0]["samples_per_s"] > 0 and rows[0]["batches_per_epoch"] == 2
    assert len(seen) == 1 and isinstance(seen[0], PackedImages) and seen[0].root == root / "train"


def test_bench_cli_on_a_packed_folder_says_what_each_side_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    root = make_packed(tmp_path)
    monkeypatch.setattr(bench_cli, "QUICK_BENCH", TINY_BENCH)
    # the workers and precision rows are measured by the tests above and test_bench_sweeps; only the data flow here
    monkeypatch.setattr(sweeps, "measure_workers", lambda *args, **kwargs: [])
    monkeypatch.setattr(sweeps, "measure_precision", lambda *args, **kwargs: [])
    monkeypatch.setenv("COLUMNS", "1000")  # rich folds a line at the console width, a long temporary path included
    out = tmp_path / "b.json"
    assert main(["bench", "--quick", "--data", str(root), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    shards = len(list((root / "train").glob("shard-*.tar")))
    text = " ".join(printed.split())
    assert (f"data: {root}, packed by 'trainfast pack': 16 images in {shards} shard(s), shorter side at most 18 px; "
            "the workers rows and both naive vs trainfast runs read the packed shards (the naive run decodes them in "
            "full, in the main process)") in text
    assert f"data: {root}/train, packed by 'trainfast pack'" in text  # the workers table's note
    assert "both read the packed shards ('trainfast pack'), the naive run decoding them in full" in text
    report = json.loads(out.read_text())
    assert report["data_format"] == "packed" and report["dataset"] == str(root)
    assert report["naive_vs_trainfast"]["reads"]["naive"] == {"format": "packed", "decode": "full", "workers": 0}


def test_a_bad_packed_index_exits_2_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_packed(tmp_path)
    index = root / "train" / "index.json"
    index.write_text(json.dumps(json.loads(index.read_text()) | {"version": 99}))
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--quick", "--data", str(root)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"trainfast bench: error: --data {str(root)!r}: {str(index)!r} has " \
        "format version 99" in err
