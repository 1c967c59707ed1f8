"""Open database handles and files on a dataset, found by their attribute path before the workers fork."""

from __future__ import annotations

import io
import logging
import sqlite3
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, Dataset, Subset

from trainfast.envcheck.checks import DB_FIX, db_handles_check
from trainfast.envcheck.handles import find_handles, handle_kind


class Records(Dataset[int]):
    def __init__(self, **attributes: Any) -> None:
        self.n = 4
        self.__dict__.update(attributes)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


@pytest.fixture
def open_file(tmp_path: Path) -> Iterator[io.BufferedReader]:
    path = tmp_path / "shard.bin"
    path.write_bytes(b"\0" * 16)
    with path.open("rb") as f:
        yield f


def test_a_sqlite_connection_on_the_dataset_is_named(db: sqlite3.Connection) -> None:
    c = db_handles_check(Records(db=db))
    assert c.status == "warn"
    assert "dataset.db is a sqlite3.Connection" in c.detail and "fork" in c.detail
    assert c.fix == DB_FIX and "__getitem__" in c.fix and "worker_init_fn" in c.fix


def test_a_closed_connection_is_no_handle() -> None:
    conn = sqlite3.connect(":memory:")
    conn.close()
    assert db_handles_check(Records(db=conn)).status == "ok"


def test_nested_handles_are_found_one_level_in(db: sqlite3.Connection, open_file: io.BufferedReader) -> None:
    class Store:
        def __init__(self) -> None:
            self.conn = db

    dataset = Records(store=Store(), shards=[open_file], by_name={"main": db})
    assert find_handles(dataset) == [("dataset.by_name['main']", "a sqlite3.Connection"),
                                     ("dataset.shards[0]", "an open file"),
                                     ("dataset.store.conn", "a sqlite3.Connection")]


def test_torch_wrappers_subset_and_concat(db: sqlite3.Connection) -> None:
    inner = Records(db=db)
    assert find_handles(Subset(inner, [0, 1])) == [("dataset.dataset.db", "a sqlite3.Connection")]
    assert find_handles(ConcatDataset([Records(), inner])) == [("dataset.datasets[1].db", "a sqlite3.Connection")]


def test_an_open_file_is_found_and_a_closed_one_is_not(open_file: io.BufferedReader, tmp_path: Path) -> None:
    c = db_handles_check(Records(f=open_file))
    assert c.status == "warn" and "dataset.f is an open file" in c.detail
    closed = (tmp_path / "x").open("w")
    closed.close()
    assert db_handles_check(Records(f=closed)).status == "ok"


def test_in_memory_buffers_std_streams_and_loggers_are_not_handles() -> None:
    import sys

    logger = logging.getLogger("trainfast.test.envcheck")
    dataset = Records(buf=io.BytesIO(b"x"), text=io.StringIO("y"), out=sys.stdout, err=sys.stderr, log=logger)
    assert db_handles_check(dataset).status == "ok"


def test_lmdb_and_h5py_are_recognised_by_type_without_importing_them(db: sqlite3.Connection) -> None:
    env_type = type("Environment", (), {"__module__": "lmdb.cpython"})
    file_type = type("File", (), {"__module__": "h5py._hl.files"})
    other = type("Environment", (), {"__module__": "gym.envs"})
    assert handle_kind(env_type()) == "an lmdb Environment"
    assert handle_kind(file_type()) == "an open h5py.File"
    assert handle_kind(other()) is None
    c = db_handles_check(Records(env=env_type(), db=db))
    assert "dataset.db is a sqlite3.Connection" in c.detail and "dataset.env is an lmdb Environment" in c.detail


def test_an_open_zipfile(tmp_path: Path) -> None:
    path = tmp_path / "a.zip"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("a.txt", "a")
    with zipfile.ZipFile(path) as z:
        assert find_handles(Records(archive=z)) == [("dataset.archive", "an open zipfile.ZipFile")]
    assert find_handles(Records(archive=z)) == []  # closed now


def test_odd_objects_do_not_crash_the_scan(db: sqlite3.Connection) -> None:
    class Raising:
        @property
        def handle(self) -> Any:
            raise RuntimeError("touched the property")

        def __getattr__(self, name: str) -> Any:
            raise RuntimeError(f"touched __getattr__({name})")

    class BadClass:
        @property  # type: ignore[misc]
        def __class__(self) -> type:
            raise RuntimeError("touched __class__")

    class Slotted:
        __slots__ = ("conn", "unset")

        def __init__(self) -> None:
            self.conn = db

    class BadDict(dict[str, Any]):
        def items(self) -> Any:
            raise RuntimeError("touched items()")

    cycle: list[Any] = []
    cycle.append(cycle)
    dataset = Records(odd=Raising(), bad=BadClass(), slotted=Slotted(), mapping=BadDict(x=1), cycle=cycle,
                      array=np.zeros(3), tensor=torch.zeros(3), paths=[f"{i}.jpg" for i in range(100_000)],
                      kind=Records)
    c = db_handles_check(dataset)
    assert c.status == "warn" and c.detail.startswith("dataset.slotted.conn is a sqlite3.Connection")
    assert db_handles_check(Raising()).status == "ok"
    assert db_handles_check(None).status == "ok"
    assert db_handles_check(42).status == "ok"


def test_with_no_workers_a_handle_is_only_info(db: sqlite3.Connection) -> None:
    c = db_handles_check(Records(db=db), num_workers=0)
    assert c.status == "info" and "dataset.db is a sqlite3.Connection" in c.detail and "num_workers=0" in c.detail
    assert c.fix == DB_FIX
    assert db_handles_check(Records(db=db), num_workers=2).status == "warn"


def test_a_clean_dataset_is_ok() -> None:
    c = db_handles_check(Records(path="data.db", items=list(range(10))))
    assert c.status == "ok" and "Records" in c.detail and c.fix == ""
