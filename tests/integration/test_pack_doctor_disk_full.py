"""`trainfast pack` and the doctor's `--json` / `--html` on a volume that fills up: one message naming the file, the
bytes needed and free and what is kept, an exit code, never a traceback. `pack` keeps the complete shards and a
rerun writes only the rest; the doctor prints its report first. Faked (ENOSPC from the write) and, where this
process may mount one, on a real (tmpfs) volume."""

from __future__ import annotations

import errno
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from trainfast.atomic import TEMP_PREFIX
from trainfast.cli import main
from trainfast.data import PackedImages, packing

SCRIPTS = Path(__file__).parent / "scripts"
LOOP = ("import torch\nm = torch.nn.Linear(4, 2)\no = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for i in range(200):\n    m(torch.randn(8, 4)).sum().backward()\n    o.step()\n    o.zero_grad()\n")


def pack_args(src: Path, dst: Path, workers: int) -> list[str]:
    """16 train and 8 val shards of 20 KiB from the tiny dataset (48 px images, 16 KiB target)."""
    return ["pack", str(src), str(dst), "--max-size", "48", "--shard-bytes", "16KiB", "--workers", str(workers)]


def errors(err: str, command: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith(f"trainfast {command}: error:")]


def temporary_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.name.startswith(TEMP_PREFIX)]


def test_pack_on_a_full_volume_keeps_the_complete_shards_and_a_rerun_finishes(
        tiny_images: Path, tmp_path: Path, full_volume: Any, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "packed"
    full_volume.atomic_writes_from(3, packing)  # shards 0 and 1 fit, 2 does not
    assert main(pack_args(tiny_images, dst, workers=1)) == 1
    lines = errors(capsys.readouterr().err, "pack")
    train = dst / "train"
    assert len(lines) == 1
    assert lines[0].startswith(f"trainfast pack: error: could not write pack file {str(train / 'shard-000002.tar')!r}: "
                               f"No space left on device (errno {errno.ENOSPC}); {str(train)!r} has "), lines[0]
    assert re.search(r"free, the file needs 20\.0 KiB\. 2 of 16 shard\(s\) in .* are complete and kept; the 14 missing "
                     r"need about 280\.0 KiB: rerun the same command once there is room, it writes only those\. Fix: "
                     r"free space in ", lines[0]), lines[0]
    assert sorted(p.name for p in train.glob("shard-*")) == ["shard-000000.tar", "shard-000001.tar"]
    assert not temporary_files(dst)
    full_volume.monkeypatch.undo()
    assert main(pack_args(tiny_images, dst, workers=1)) == 0
    assert "16 written" not in (out := capsys.readouterr().out) and "14 written, 2 kept from an earlier run" in out
    assert len(PackedImages(train, image_size=32)) == 80


def test_pack_on_a_real_full_volume_with_workers_then_with_room(
        tiny_images: Path, mount_tmpfs: Callable[[str], Any], capsys: pytest.CaptureFixture[str]) -> None:
    volume = mount_tmpfs("256k")  # the train split alone takes 320 KiB
    dst = volume.path / "packed"
    assert main(pack_args(tiny_images, dst, workers=2)) == 1
    lines = errors(capsys.readouterr().err, "pack")
    assert len(lines) == 1
    assert lines[0].startswith(f"trainfast pack: error: could not write pack file '{dst / 'train'}/shard-"), lines[0]
    assert f"No space left on device (errno {errno.ENOSPC})" in lines[0]
    assert "are complete and kept" in lines[0] and "rerun the same command once there is room" in lines[0]
    assert not temporary_files(dst)
    kept = len(list((dst / "train").glob("shard-*.tar")))
    volume.resize("2m")
    assert main(pack_args(tiny_images, dst, workers=2)) == 0
    assert f"{16 - kept} written, {kept} kept from an earlier run" in capsys.readouterr().out
    assert len(PackedImages(dst / "train", image_size=32)) == 80 and len(PackedImages(dst / "val", image_size=32)) == 40


def doctor(script: Path, json_path: Path, html_path: Path) -> int:
    return main(["doctor", "--steps", "3", "--warmup", "1", "--json", str(json_path), "--html", str(html_path),
                 str(script)])


def assert_reports_not_written(err: str, json_path: Path, html_path: Path) -> None:
    lines = errors(err, "doctor")
    assert len(lines) == 2, err
    for line, what, path in zip(lines, ("JSON", "HTML"), (json_path, html_path), strict=True):
        assert line.startswith(f"trainfast doctor: error: could not write the {what} report {str(path)!r}: No space "
                               f"left on device (errno {errno.ENOSPC}); {str(path.parent)!r} has "), line
        assert line.endswith(f"The report above is complete; only this file is missing. Fix: free space in "
                             f"{str(path.parent)!r}, or give a path on another volume"), line
    assert not json_path.exists() and not html_path.exists()


def test_doctor_reports_on_a_full_volume_print_the_report_then_one_message_each(
        tmp_path: Path, full_volume: Any, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    full_volume.atomic_writes_from(1)
    json_path, html_path = tmp_path / "out" / "r.json", tmp_path / "r.html"
    assert doctor(script, json_path, html_path) == 1  # the script was stopped (0): the lost files make it 1
    captured = capsys.readouterr()
    assert "verdict:" in captured.out and "JSON report:" not in captured.out
    assert_reports_not_written(captured.err, json_path, html_path)
    assert not temporary_files(tmp_path)
    # a script that failed keeps its own exit code
    assert doctor(SCRIPTS / "exits.py", json_path, html_path) == 3
    assert_reports_not_written(capsys.readouterr().err, json_path, html_path)


def test_doctor_reports_on_a_real_full_volume(tmp_path: Path, mount_tmpfs: Callable[[str], Any],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    volume = mount_tmpfs("64k")
    (volume.path / "filler").write_bytes(bytes(60 * 1024))  # 4 KiB left: the reports take 9 KiB and more
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    json_path, html_path = volume.path / "r.json", volume.path / "r.html"
    assert doctor(script, json_path, html_path) == 1
    captured = capsys.readouterr()
    assert "verdict:" in captured.out
    assert_reports_not_written(captured.err, json_path, html_path)
    assert not temporary_files(volume.path)


@pytest.mark.parametrize("command", ["demo", "bench", "bench --plot"])
def test_report_files_of_the_other_commands_on_a_full_volume_are_one_message(
        command: str, tmp_path: Path, full_volume: Any, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`demo --json`, `bench --json` / `--plot` on a full volume: the work is done (faked here: only the file is
    under test), the file is not written, one message, exit 1. (`tune --json` writes through the same
    `write_output`.)"""
    from trainfast.bench import plot
    from trainfast.cli import bench, demo

    out = tmp_path / ("out.png" if "plot" in command else "out.json")
    if command == "demo":
        monkeypatch.setattr(demo, "run_demo", lambda spec, repeats: {"runs": []})
        args = ["demo", "--quick", "--json", str(out)]
    else:
        monkeypatch.setattr(bench, "run_bench", lambda spec, root, progress, command: {})
        monkeypatch.setattr(bench, "render", lambda report, console: None)
        monkeypatch.setattr(bench, "ensure_demo_dataset", lambda name, seed: tmp_path)  # no images to make
        monkeypatch.setattr(plot, "require_matplotlib", lambda: None)  # the figure is not under test
        monkeypatch.setattr(plot, "plot_png", lambda report: bytes(1000))
        args = ["bench", "--quick", "--plot" if "plot" in command else "--json", str(out)]
    full_volume.atomic_writes_from(1)
    assert main(args) == 1
    [message] = errors(capsys.readouterr().err, command.split()[0])
    assert out.name in message and "only this file is missing" in message, message
    assert not out.exists() and not temporary_files(tmp_path)


def test_pack_into_a_folder_that_cannot_be_made_is_one_message(
        tiny_images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "packed"
    make_folder = Path.mkdir

    def mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        if self.is_relative_to(dst):  # as mkdir on a volume with no free block or inode fails
            raise OSError(errno.ENOSPC, "No space left on device")
        make_folder(self, *args, **kwargs)
    monkeypatch.setattr(Path, "mkdir", mkdir)
    assert main(pack_args(tiny_images, dst, workers=1)) == 1
    [line] = errors(capsys.readouterr().err, "pack")
    assert line.startswith(f"trainfast pack: error: could not write pack file {str(dst / 'train')!r}: No space left "
                           f"on device (errno {errno.ENOSPC}); {str(dst)!r} has "), line
    assert "nothing was packed yet" in line, line
