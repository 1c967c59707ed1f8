"""`trainfast env` and `trainfast env --json`, through a parser of the test's own (as the CLI will wire it)."""

from __future__ import annotations

import argparse
import importlib
import json

import pytest

from trainfast.cli import env
from trainfast.envcheck import CONTRACT_FIELDS

environment_module = importlib.import_module("trainfast.envcheck.environment")
checks_module = importlib.import_module("trainfast.envcheck.checks")


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trainfast")
    sub = parser.add_subparsers()
    env.register(sub)
    args = parser.parse_args(argv)
    return int(args.run(args, args.command_parser))


def test_env_json_prints_the_contract_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["env", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(CONTRACT_FIELDS) <= set(data)
    assert {c["name"] for c in data["checks"]} >= {"cpu", "shm", "open_files", "cuda_versions", "nvml", "tf32"}


def test_env_prints_the_checks_and_the_fenced_block(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["env"]) == 0
    out = capsys.readouterr().out
    for name in ("cpu", "shm", "open_files", "cuda_versions", "nvml", "tf32", "cuda_alloc_conf"):
        assert name in out
    assert "```text\n" in out and out.rstrip().endswith("```")
    assert out.index("cuda_alloc_conf") < out.index("```text")  # the table first, then the block
    assert "Python " in out and "torch " in out


def test_env_exits_0_with_warnings(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:

    monkeypatch.setattr(checks_module, "read_shm_bytes", lambda: 64 * 2**20)
    monkeypatch.setattr(checks_module, "read_open_files_limit", lambda: 256)
    assert _run(["env"]) == 0
    out = capsys.readouterr().out
    assert "warn" in out and "[warn] shm:" in out and "[warn] open_files:" in out


def test_env_help_has_a_worked_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _run(["env", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "trainfast env --json" in out and "examples:" in out and "--json" in out


def test_env_rejects_unknown_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _run(["env", "--verbose"])
    assert exit_info.value.code == 2
