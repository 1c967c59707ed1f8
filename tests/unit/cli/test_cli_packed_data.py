"""`--data DIR` written by `trainfast pack`, for `trainfast tune` as for `trainfast train`: the shared `open_data`
(one decision, the same exit-2 errors), tune over the packed training split, and its tuned-cache entry, which
`trainfast train --workers tuned` on the same folder reads."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from helpers import make_packed
from trainfast.cli import main
from trainfast.cli.flags import open_data
from trainfast.data import ImageFolder, PackedImages
from trainfast.data.packing import INDEX_NAME
from trainfast.loader import tuned

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def packed(tmp_path: Path) -> Path:
    return make_packed(tmp_path)


def parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog="trainfast x")


def test_open_data_reads_a_packed_folder_and_an_image_folder(tmp_path: Path) -> None:
    dst = make_packed(tmp_path)
    train, val = open_data(dst, parser(), image_size=16)
    assert isinstance(train, PackedImages) and isinstance(val, PackedImages)
    assert (len(train), len(val), train.root, val.train) == (16, 8, dst / "train", False)
    assert open_data(dst, parser(), image_size=16, val=False)[1] is None
    train, val = open_data(tmp_path / "src", parser(), image_size=16, on_bad_sample="skip")
    assert isinstance(train, ImageFolder) and isinstance(val, ImageFolder)
    assert (len(train), len(val), train.on_bad_sample) == (16, 8, "skip")


def test_a_packed_folder_without_val_has_no_val_set(tmp_path: Path) -> None:
    dst = make_packed(tmp_path, val=0)
    (dst / "val").mkdir()  # a folder without index.json is not a packed split
    train, val = open_data(dst, parser(), image_size=16)
    assert isinstance(train, PackedImages) and val is None


@pytest.mark.parametrize(("layout", "message"), [
    ("missing", "does not exist"),
    ("no-train", "has no 'train' folder"),
    ("one-split", "is one packed split"),
    ("old-index", "format version 0"),
    ("empty-index", "lists no images"),
])
def test_bad_data_exits_2_naming_the_path(packed: Path, capsys: pytest.CaptureFixture[str], layout: str,
                                          message: str) -> None:
    root = packed
    index = packed / "train" / INDEX_NAME
    if layout == "missing":
        root = packed / "nothing"
    elif layout == "no-train":
        root = packed.parent / "plain"
        root.mkdir()
    elif layout == "one-split":
        root = packed / "val"  # what `pack` writes for a source without train/ and val/
    else:
        data = json.loads(index.read_text())
        data.update({"version": 0} if layout == "old-index" else {"key": []})
        index.write_text(json.dumps(data))
    for command in ("train", "tune"):
        with pytest.raises(SystemExit) as exit_info:
            open_data(root, argparse.ArgumentParser(prog=f"trainfast {command}"), image_size=16)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err and str(root) in err, err
        assert f"trainfast {command}: error:" in err


def test_tune_on_a_packed_folder_caches_what_train_reads(packed: Path, cache_dir: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tune.json"
    assert main(["tune", "--data", str(packed), "--image-size", "16", "--batch-size", "4", "--no-step",
                 "--budget-s", "4", "--device", "cpu", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"data: {packed / 'train'}, packed by 'trainfast pack': 16 images in " in printed
    assert "shorter side at most 18 px" in printed and "◀ chosen" in printed
    result = json.loads(out.read_text())
    assert result["describes"]["dataset"].startswith("trainfast.data.packed.PackedImages:16:")
    assert str((packed / "train").resolve()) in result["describes"]["dataset"]
    # `trainfast train --data DIR --image-size 16 --batch-size 4 --workers tuned` builds this dataset: same key
    train_set, _ = open_data(packed, parser(), image_size=16)
    assert tuned.load(train_set, 4, device="cpu") is not None


def test_train_with_tuned_workers_tunes_the_training_loader_and_validates_on_auto(
        packed: Path, cache_dir: Path, trainfast_log: pytest.LogCaptureFixture) -> None:
    assert main(["tune", "--data", str(packed), "--image-size", "16", "--batch-size", "4", "--no-step",
                 "--budget-s", "2", "--device", "cpu"]) == 0
    trainfast_log.clear()
    assert main(["train", "--data", str(packed), "--image-size", "16", "--batch-size", "4", "--workers", "tuned",
                 "--epochs", "1", "--precision", "32-true", "--channels-last", "false", "--device", "cpu",
                 "--no-progress"]) == 0
    plans = [r.getMessage() for r in trainfast_log.records if r.getMessage().startswith("make_loader:")]
    assert len(plans) == 2 and "tuned by measurement" in plans[0] and "tuned" not in plans[1], plans
    assert not any("no tuning result" in r.getMessage() for r in trainfast_log.records)


def test_tune_on_a_packed_folder_smaller_than_one_batch_exits_2(packed: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "--data", str(packed), "--batch-size", "32", "--image-size", "16", "--no-step"]) == 2
    assert (f"trainfast tune: error: --data {str(packed)!r} has 16 training image(s), fewer than one batch of "
            "--batch-size 32; give --batch-size 16 or less, or more images") in capsys.readouterr().err


def test_help_names_the_packed_layout(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("tune", "bench"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        out = capsys.readouterr().out
        assert exit_info.value.code == 0 and "trainfast pack" in out and "-packed" in out, command
