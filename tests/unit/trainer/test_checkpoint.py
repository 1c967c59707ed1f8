"""Checkpoints: atomic writes (old file intact after a failed save), verified and pickle-free reads, RNG state."""

from __future__ import annotations

import io
import os
import random
import re
import stat
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pytest
import torch

from trainfast.atomic import TEMP_PREFIX, atomic_copy, atomic_write, temp_path
from trainfast.trainer.checkpoint import (
    CheckpointError,
    atomic_save,
    load_checkpoint,
    rng_state,
    set_rng_state,
    versions,
)


def _state(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, generator=gen), "b": torch.arange(10)}, "step": 7 + seed,
            "optimizer": {"lr": 0.1}}


def _temp_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(TEMP_PREFIX))


@pytest.fixture
def umask() -> Iterator[None]:
    old = os.umask(0o022)
    os.umask(old)
    yield
    os.umask(old)


def test_atomic_save_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "last.pt"  # the folder is created
    assert atomic_save(_state(), path) == path
    loaded = load_checkpoint(path)
    assert set(loaded) == {"model", "step", "optimizer"}
    assert torch.equal(loaded["model"]["w"], _state()["model"]["w"])
    assert torch.equal(loaded["model"]["b"], torch.arange(10))
    assert loaded["step"] == 7
    assert _temp_files(path.parent) == []


def test_atomic_save_accepts_a_str_path_and_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "last.pt"
    atomic_save(_state(0), str(path))
    atomic_save(_state(1), str(path))
    assert load_checkpoint(str(path))["step"] == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt(), OSError(28, "No space left")],
                         ids=["error", "interrupt", "enospc"])
def test_failed_save_leaves_the_previous_file_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     error: BaseException) -> None:
    path = tmp_path / "last.pt"
    atomic_save(_state(0), path)
    before = path.read_bytes()
    seen: list[str] = []

    def torn_save(obj: object, f: BinaryIO, *args: object, **kwargs: object) -> None:
        f.write(b"PK\x03\x04" + b"half a checkpoint" * 1000)
        f.flush()
        seen.extend(_temp_files(tmp_path))  # the bytes go to a temp file next to the target
        raise error

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(type(error)):
        atomic_save(_state(1), path)
    assert len(seen) == 1 and seen[0].startswith(f"{TEMP_PREFIX}last.pt.")
    assert path.read_bytes() == before
    assert _temp_files(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 7


def test_failed_first_save_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(obj: object, f: BinaryIO, *args: object, **kwargs: object) -> None:
        f.write(b"x" * 100)
        raise RuntimeError("boom")

    monkeypatch.setattr(torch, "save", failing)
    with pytest.raises(RuntimeError, match="boom"):
        atomic_save(_state(), tmp_path / "best.pt")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600), (0o027, 0o640)])
def test_permissions_follow_the_umask(tmp_path: Path, umask: None, mask: int, mode: int) -> None:
    os.umask(mask)
    saved = atomic_save(_state(), tmp_path / "ckpt.pt")
    copied = atomic_copy(saved, tmp_path / "copy.pt")
    assert stat.S_IMODE(saved.stat().st_mode) == mode
    assert stat.S_IMODE(copied.stat().st_mode) == mode


def _flip_byte_in_tensor_data(path: Path) -> str:
    """Flip one byte inside the first stored tensor's bytes; return the zip member's name."""
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if re.search(r"/data/\d+$", i.filename) and i.file_size >= 16)
        assert info.compress_type == zipfile.ZIP_STORED
    data = bytearray(path.read_bytes())
    off = info.header_offset
    assert data[off:off + 4] == b"PK\x03\x04"
    name_len, extra_len = struct.unpack("<HH", data[off + 26:off + 30])
    start = off + 30 + name_len + extra_len
    data[start + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    return info.filename


def test_a_flipped_byte_in_tensor_data_is_a_crc_error(tmp_path: Path) -> None:
    path = atomic_save(_state(), tmp_path / "last.pt")
    member = _flip_byte_in_tensor_data(path)
    assert torch.load(path, weights_only=True)["step"] == 7  # torch itself would load the damaged tensor silently
    with pytest.raises(CheckpointError, match=rf"{re.escape(repr(str(path)))} is corrupt: CRC mismatch in "
                                              rf"{re.escape(repr(member))}"):
        load_checkpoint(path)


@pytest.mark.parametrize("damage", ["truncated_half", "truncated_tail", "empty", "garbage"])
def test_truncated_or_foreign_files_are_checkpoint_errors(tmp_path: Path, damage: str) -> None:
    path = atomic_save(_state(), tmp_path / "last.pt")
    data = path.read_bytes()
    damaged = {"truncated_half": data[: len(data) // 2], "truncated_tail": data[:-10], "empty": b"",
               "garbage": b"not a checkpoint\n" * 100}[damage]
    path.write_bytes(damaged)
    with pytest.raises(CheckpointError, match=rf"{re.escape(repr(str(path)))}.*truncated or not a torch.save file"):
        load_checkpoint(path)


@pytest.mark.parametrize("name", ["missing.pt", "sub/missing.pt", "."])
def test_missing_file_names_the_path(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    with pytest.raises(CheckpointError, match=rf"no checkpoint at {re.escape(repr(str(path)))}"):
        load_checkpoint(path)


@pytest.mark.parametrize("obj", [[1, 2, 3], {"step": 3}, torch.zeros(2)], ids=["list", "no_model", "tensor"])
def test_a_torch_file_that_is_not_a_checkpoint_is_refused(tmp_path: Path, obj: object) -> None:
    path = tmp_path / "x.pt"
    torch.save(obj, path)
    with pytest.raises(CheckpointError, match=rf"{re.escape(repr(str(path)))} is not a trainfast checkpoint"):
        load_checkpoint(path)


SIDE_EFFECTS: list[str] = []


def _record(what: str) -> str:
    SIDE_EFFECTS.append(what)
    return what


class ReducePayload:
    """Unpickling this calls `_record`: arbitrary code execution, as a malicious file would do."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_record, ("__reduce__ ran",))


class SetStatePayload:
    def __init__(self) -> None:
        self.value = 1

    def __setstate__(self, state: dict[str, Any]) -> None:
        SIDE_EFFECTS.append("__setstate__ ran")
        self.__dict__.update(state)


@pytest.mark.parametrize("payload", [ReducePayload, SetStatePayload])
def test_pickled_objects_are_refused_and_never_run(tmp_path: Path, payload: type) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.zeros(2)}, "x": payload()}, path)
    SIDE_EFFECTS.clear()
    try:
        torch.load(path, weights_only=False)  # the payload is live: a full unpickle runs it
        assert SIDE_EFFECTS != []
        SIDE_EFFECTS.clear()
        with pytest.raises(CheckpointError, match=rf"{re.escape(repr(str(path)))} cannot be loaded safely"):
            load_checkpoint(path)
        assert SIDE_EFFECTS == []
    finally:
        SIDE_EFFECTS.clear()


def _draws() -> tuple[Any, ...]:
    return (torch.rand(5), torch.randint(0, 10**6, (3,)), np.random.standard_normal(3), np.random.randint(0, 10**6, 4),
            np.random.standard_normal(), [random.random() for _ in range(4)], random.gauss(0.0, 1.0),
            random.getrandbits(64))


def _assert_same(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        elif isinstance(x, np.ndarray):
            assert np.array_equal(x, y)
        else:
            assert x == y


@pytest.mark.parametrize("through_torch_save", [False, True])
@pytest.mark.parametrize("cached_gaussians", [False, True])
def test_rng_state_round_trip_restores_every_stream(saved_rngs: None, through_torch_save: bool,
                                                    cached_gaussians: bool) -> None:
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    if cached_gaussians:  # an odd number of normal draws leaves a cached value in numpy and in random
        np.random.standard_normal()
        random.gauss(0.0, 1.0)
    state = rng_state()
    if through_torch_save:
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        state = torch.load(buf, weights_only=True)
    expected = _draws()
    _draws()  # move every stream on
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    set_rng_state(state)
    _assert_same(_draws(), expected)


def test_rng_state_is_weights_only_loadable_from_a_checkpoint(tmp_path: Path, saved_rngs: None) -> None:
    atomic_save({"model": {}, "rng": rng_state()}, tmp_path / "c.pt")
    expected = _draws()
    set_rng_state(load_checkpoint(tmp_path / "c.pt")["rng"])
    _assert_same(_draws(), expected)


def test_versions_lists_the_software() -> None:
    v = versions()
    assert {"trainfast", "torch", "python"} <= set(v)
    assert all(isinstance(x, str) for x in v.values())
    assert v["torch"] == str(torch.__version__)
    import trainfast

    assert v["trainfast"] == trainfast.__version__


@pytest.mark.parametrize("size", [0, 10, (1 << 20) + 7, 3 << 20])
def test_atomic_copy_copies_bytes(tmp_path: Path, size: int) -> None:
    src = tmp_path / "src.bin"
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    src.write_bytes(payload)
    dst = tmp_path / "deep" / "er" / "dst.bin"
    assert atomic_copy(src, dst) == dst
    assert dst.read_bytes() == payload
    dst.write_bytes(b"old contents that are longer than some payloads" * 10)
    atomic_copy(str(src), str(dst))
    assert dst.read_bytes() == payload
    assert _temp_files(dst.parent) == []


def test_atomic_copy_of_a_missing_source_keeps_the_target(tmp_path: Path) -> None:
    dst = tmp_path / "dst.bin"
    dst.write_bytes(b"keep me")
    with pytest.raises(FileNotFoundError):
        atomic_copy(tmp_path / "nope.bin", dst)
    assert dst.read_bytes() == b"keep me"
    assert _temp_files(tmp_path) == []


def test_atomic_write_failure_in_the_writer_cleans_up(tmp_path: Path) -> None:
    target = tmp_path / "f.txt"

    def write(f: BinaryIO) -> None:
        f.write(b"partial")
        raise ValueError("bad data")

    with pytest.raises(ValueError, match="bad data"):
        atomic_write(target, write)
    assert list(tmp_path.iterdir()) == []


def test_temp_paths_are_hidden_unique_and_in_the_same_folder(tmp_path: Path) -> None:
    target = tmp_path / "last.pt"
    names = {temp_path(target) for _ in range(50)}
    assert len(names) == 50
    for p in names:
        assert p.parent == tmp_path
        assert p.name.startswith(f"{TEMP_PREFIX}last.pt.{os.getpid()}.")
        assert p.name.endswith(".tmp")
