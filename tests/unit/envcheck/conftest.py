"""Fixtures of the environment checks' tests."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

import pytest


@pytest.fixture
def db() -> Iterator[sqlite3.Connection]:
    """An in-memory sqlite3 connection, the handle a dataset must not carry into forked workers."""
    conn = sqlite3.connect(":memory:")
    yield conn
    conn.close()
