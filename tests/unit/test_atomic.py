"""`trainfast.atomic`: which exceptions raised while writing are a failed write (`write_failure`, the one place that
decides it), the message that says so, and `write_output`, which turns one into `OutputWriteError`."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from trainfast.atomic import (
    TEMP_PREFIX,
    OutputWriteError,
    WriteFailure,
    describe_write_failure,
    write_failure,
    write_output,
)
from trainfast.units import format_bytes


def chained(error: RuntimeError, context: OSError) -> RuntimeError:
    """`error` raised while `context` was handled, as torch's writer raises its RuntimeError over the file's OSError."""
    try:
        try:
            raise context
        except OSError:
            raise error  # noqa: B904 (the implicit chain, __context__, is what torch leaves)
    except RuntimeError as e:
        return e


ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize(("error", "expected"), [
    (ENOSPC, WriteFailure(os.strerror(errno.ENOSPC), errno.ENOSPC)),
    (OSError(errno.EACCES, "Permission denied"), WriteFailure("Permission denied", errno.EACCES)),
    # torch's zip writer on a full volume (torch 2.13), with no OSError under it
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 2346560 vs 2346452"),
     WriteFailure("torch's zip writer failed ([enforce fail at inline_container.cc:672] . unexpected pos 2346560 vs "
                  "2346452)")),
    (RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"),
     WriteFailure("torch's zip writer failed (PytorchStreamWriter failed writing file data/0: file write failed)")),
    # ... and as it raises over a Python file that ran out of room: the OSError's errno is the reason
    (chained(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), ENOSPC),
     WriteFailure(os.strerror(errno.ENOSPC), errno.ENOSPC)),
    (chained(RuntimeError("some other wording of a later torch"), OSError(errno.EDQUOT, "Disk quota exceeded")),
     WriteFailure("Disk quota exceeded", errno.EDQUOT)),
    # not failed writes: a bug keeps its traceback
    (RuntimeError("CUDA error: an illegal memory access was encountered"), None),
    (chained(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), OSError(errno.EACCES, "Permission denied")),
     None),
    (ValueError("unexpected pos 1 vs 2"), None),
    (KeyboardInterrupt(), None),
])
def test_write_failure(error: BaseException, expected: WriteFailure | None) -> None:
    assert write_failure(error) == expected


@pytest.mark.parametrize(("failure", "free", "fix"), [
    (WriteFailure("No space left on device", errno.ENOSPC), 10**9, "ROOM"),  # the errno decides, not the figures
    (WriteFailure("Permission denied", errno.EACCES), 0, "OTHER"),
    (WriteFailure("torch's zip writer failed (...)"), 100, "ROOM"),  # no errno: fewer bytes free than needed
    (WriteFailure("torch's zip writer failed (...)"), 10**9, "ROOM; if it has room, OTHER"),
])
def test_the_fix_follows_the_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: WriteFailure, free: int,
                                   fix: str) -> None:
    monkeypatch.setattr("shutil.disk_usage", lambda path: SimpleNamespace(total=10**12, used=10**12 - free, free=free))
    message = describe_write_failure(tmp_path / "f.bin", 4096, failure, "Nothing else happened", what="file",
                                     room_fix="ROOM", other_fix="OTHER")
    assert message == (f"could not write file {str(tmp_path / 'f.bin')!r}: {failure}; {str(tmp_path)!r} has "
                       f"{format_bytes(free)} free, the file needs 4.0 KiB. Nothing else happened. Fix: {fix}")


def test_write_output_on_a_full_volume_raises_its_message_and_keeps_the_old_file(
        tmp_path: Path, full_volume: Any) -> None:
    path = tmp_path / "r.json"
    write_output(path, "old\n", what="the report", outcome="x")
    full_volume.atomic_writes_from(1)
    with pytest.raises(OutputWriteError) as info:
        write_output(path, "{}\n" * 1000, what="the JSON report", outcome="The report above is complete")
    assert str(info.value).startswith(f"could not write the JSON report {str(path)!r}: No space left on device "
                                      f"(errno {errno.ENOSPC}); {str(tmp_path)!r} has ")
    assert "the file needs 2.9 KiB. The report above is complete. Fix: free space in" in str(info.value)
    assert path.read_text() == "old\n"  # atomic: never a torn file
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(TEMP_PREFIX)]


def test_write_output_lets_other_errors_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(path: Any, write: Any) -> Path:
        raise TypeError("a bug")
    monkeypatch.setattr("trainfast.atomic.atomic_write", broken)
    with pytest.raises(TypeError, match="a bug"):
        write_output(tmp_path / "r.json", "{}", what="the report", outcome="x")
