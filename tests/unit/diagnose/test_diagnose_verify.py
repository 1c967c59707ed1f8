"""`doctor --verify`: the overrides injected into an unmodified script, the ranking by measured gain, and the
orchestration of fresh-process runs (with a stand-in child, so no torch import per run)."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from trainfast.diagnose.capture.inject import VALID_KEYS, apply_overrides
from trainfast.diagnose.fixes.rule import rank as rank_verified
from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.report.verify import verify_fixes

DATA = TensorDataset(torch.zeros(8, 2), torch.zeros(8))


def _globals() -> tuple[object, ...]:
    return (DataLoader.__dict__["__init__"], torch.set_num_threads, torch.get_num_threads(),
            torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)


@pytest.fixture
def restored() -> Iterator[None]:
    """Everything apply_overrides touches is exactly as before after the test."""
    before = _globals()
    yield
    assert _globals() == before


def _other_thread_count() -> int:
    return 1 if torch.get_num_threads() != 1 else 2


def test_loader_overrides_by_keyword(restored: None) -> None:
    overrides = {"num_workers": 2, "persistent_workers": True, "prefetch_factor": 4, "pin_memory": True}
    with apply_overrides(overrides):
        loader = DataLoader(DATA, batch_size=4, num_workers=0, pin_memory=False)
    assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor, loader.pin_memory) == \
        (2, True, 4, True)
    assert loader.batch_size == 4
    assert DataLoader(DATA, batch_size=4).num_workers == 0  # only while active


def test_loader_overrides_positional_arguments(restored: None) -> None:
    with apply_overrides({"num_workers": 2, "pin_memory": True}):
        #                        batch  shuffle sampler batch_sampler workers collate pin
        loader = DataLoader(DATA, 4, False, None, None, 0, None, False)
    assert (loader.num_workers, loader.pin_memory, loader.batch_size) == (2, True, 4)


def test_loader_override_reaches_subclasses(restored: None) -> None:
    class MyLoader(DataLoader[Any]):
        def __init__(self, dataset: Dataset[Any]) -> None:
            super().__init__(dataset, batch_size=2, num_workers=0)

    with apply_overrides({"num_workers": 1, "persistent_workers": True}):
        loader = MyLoader(DATA)
    assert (loader.num_workers, loader.persistent_workers) == (1, True)


def test_zero_workers_override_drops_worker_only_arguments(restored: None) -> None:
    with apply_overrides({"num_workers": 0, "persistent_workers": True, "prefetch_factor": 4}):
        loader = DataLoader(DATA, batch_size=4, num_workers=2, persistent_workers=True, prefetch_factor=3,
                            multiprocessing_context="spawn")
    assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor) == (0, False, None)
    assert loader.multiprocessing_context is None


def test_worker_only_overrides_skipped_without_workers(restored: None) -> None:
    with apply_overrides({"persistent_workers": True, "prefetch_factor": 4}):
        loader = DataLoader(DATA, batch_size=4)  # the script's num_workers=0: the overrides cannot apply
        workers = DataLoader(DATA, batch_size=4, num_workers=1)
    assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor) == (0, False, None)
    assert (workers.persistent_workers, workers.prefetch_factor) == (True, 4)


def test_invalid_call_still_raises_the_constructors_own_error(restored: None) -> None:
    with apply_overrides({"num_workers": 2}), pytest.raises(TypeError):
        DataLoader(DATA, batch_size=4, no_such_argument=1)  # type: ignore[call-arg]


def test_threads_pinned_and_script_calls_ignored(restored: None) -> None:
    before = torch.get_num_threads()
    pinned = _other_thread_count()
    with apply_overrides({"threads": pinned}):
        assert torch.get_num_threads() == pinned
        torch.set_num_threads(before)  # what the script does: ignored while the fix is measured
        assert torch.get_num_threads() == pinned
    assert torch.get_num_threads() == before
    torch.set_num_threads(before)  # the real function again


class _Threads(Dataset[int]):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> int:
        return torch.get_num_threads()


@pytest.mark.skipif(sys.platform != "linux", reason="forked workers (Linux's default start method)")
def test_forked_worker_sets_its_own_threads(restored: None) -> None:
    """A DataLoader worker's own torch.set_num_threads(1) still works under a threads override of 2."""
    with apply_overrides({"threads": 2}):
        seen = [int(t) for batch in DataLoader(_Threads(), batch_size=1, num_workers=1) for t in batch]
    assert seen == [1, 1]


def test_cudnn_benchmark_and_tf32(restored: None) -> None:
    with apply_overrides({"cudnn_benchmark": True, "tf32": True}):
        assert torch.backends.cudnn.benchmark is True
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cudnn.allow_tf32 is True


def test_the_scripts_autocast_runs_disabled(restored: None) -> None:
    """The fp32 fix: every autocast the script enters (positional or keyword `enabled`) computes in float32."""
    ones = torch.ones(2, 2)
    with apply_overrides({"autocast": False}):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert (ones @ ones).dtype == torch.float32
        with torch.autocast("cpu", torch.bfloat16, True):
            assert (ones @ ones).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (ones @ ones).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="give false"), apply_overrides({"autocast": True}):
        pass


def test_everything_restored_after_an_exception(restored: None) -> None:
    overrides = {"num_workers": 2, "threads": _other_thread_count(), "cudnn_benchmark": True, "tf32": True}
    with pytest.raises(RuntimeError, match="the script crashed"), apply_overrides(overrides):
        raise RuntimeError("the script crashed")


def test_unknown_key_names_it_and_lists_the_valid_ones(restored: None) -> None:
    with pytest.raises(ValueError, match="unknown override 'workers'") as info, \
            apply_overrides({"num_workers": 2, "workers": 2}):
        pass
    assert all(key in str(info.value) for key in VALID_KEYS)


@pytest.mark.parametrize("overrides", [{"num_workers": -1}, {"num_workers": True}, {"threads": 0},
                                       {"prefetch_factor": 1.5}, {"pin_memory": "yes"}])
def test_bad_values_rejected(overrides: dict[str, Any], restored: None) -> None:
    with pytest.raises(ValueError, match=f"override {next(iter(overrides))}="), apply_overrides(overrides):
        pass


# ---------------------------------------------------------------------------------------------- ranking


def rec(id: str, expected: float | None, measured: float | None = None) -> Recommendation:
    return Recommendation(id, id, "why", "fix", expected, overrides={"threads": 1} if measured else None,
                          measured_gain=measured)


@pytest.mark.parametrize(("recs", "order"), [
    ([], []),
    # measured gain ranks over the expected one
    ([rec("a", 3.0, 1.2), rec("b", 1.5, 2.0)], ["b", "a"]),
    # the fixes measured to pay come before the unmeasured ones, whatever those expect
    ([rec("a", 3.0, 1.2), rec("b", 1.5), rec("c", 1.1, 1.8)], ["c", "a", "b"]),
    ([rec("decode_size", 1.73), rec("num_workers", 2.0, 1.7)], ["num_workers", "decode_size"]),
    # no estimate at all: after every estimated fix
    ([rec("n", None), rec("a", 1.05)], ["a", "n"]),
    # slower when measured: last, after the unestimated, however large the expected gain
    ([rec("slow", 5.0, 0.8), rec("n", None), rec("a", 1.1)], ["a", "n", "slow"]),
    ([rec("s1", 2.0, 0.5), rec("s2", 2.0, 0.9)], ["s2", "s1"]),
    # exactly 1.0 is not slower
    ([rec("even", 9.0, 1.0), rec("n", None)], ["even", "n"]),
    # ties keep the doctor's order
    ([rec("x", 1.5), rec("y", 1.5, 1.5), rec("z", 1.5)], ["y", "x", "z"]),
    ([rec("x", 1.5), rec("z", 1.5)], ["x", "z"]),
])
def test_rank_verified(recs: list[Recommendation], order: list[str]) -> None:
    assert [r.id for r in rank_verified(recs)] == order


# ------------------------------------------------------------------------------------------ orchestration

# Stands in for `python -m trainfast.diagnose.report.verify SPEC.json`: samples/s from the overrides, a crash, a hang.
FAKE_CHILD = textwrap.dedent("""
    import json, os, sys, time
    spec = json.load(open(sys.argv[-1]))
    o = spec["overrides"]
    with open(os.environ["VERIFY_LOG"], "a") as log:
        log.write(json.dumps({"overrides": o, "env": sorted(os.environ.items()), "cwd": os.getcwd()}) + "\\n")
    if o.get("prefetch_factor") == 3:
        print("Traceback: the child fell over", flush=True)
        sys.exit(1)
    if o.get("prefetch_factor") == 4:
        print("stuck", flush=True)
        time.sleep(60)
    rate = 100.0 * o.get("num_workers", 1) * (0.5 if o.get("pin_memory") else 1)
    report = {"samples_per_s": rate, "verdict": "input-bound", "data_wait_fraction": 0.5,
              "loaders": [{"index": 0, "kind": "DataLoader", "num_workers": o.get("num_workers", 0),
                           "pin_memory": bool(o.get("pin_memory")),
                           "persistent_workers": bool(o.get("persistent_workers")), "prefetch_factor": None}]}
    # the script's loss over steps 0-9, measured 2-9; persistent workers train on another dataset: 1.0 higher
    losses = [2.0 - 0.05 * i + 0.02 * (i % 2) + (1.0 if o.get("persistent_workers") else 0.0) for i in range(10)]
    loss = {"first": 0, "values": losses, "steps": [2, 9], "unseen": None}
    json.dump({"exit_code": 0, "error": None, "report": report, "loss": loss}, open(spec["out"], "w"))
""")


@pytest.fixture
def fake_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    script = tmp_path / "fake_child.py"
    script.write_text(FAKE_CHILD)
    launcher = tmp_path / "python"
    launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    launcher.chmod(launcher.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(sys, "executable", str(launcher))
    monkeypatch.setenv("VERIFY_LOG", str(tmp_path / "children.jsonl"))
    return tmp_path / "children.jsonl"


@pytest.mark.skipif(os.name != "posix", reason="a /bin/sh stand-in for the child interpreter")
@pytest.mark.slow
def test_verify_fixes_aba_gains_failures_and_ranking(fake_child: Path, tmp_path: Path) -> None:
    recs = [
        Recommendation("slower", "t", "w", "f", 4.0, overrides={"pin_memory": True}),
        Recommendation("crash", "t", "w", "f", 3.0, overrides={"prefetch_factor": 3, "num_workers": 2}),
        Recommendation("hang", "t", "w", "f", 2.5, overrides={"prefetch_factor": 4, "num_workers": 2}),
        Recommendation("faster", "t", "w", "f", 1.2, overrides={"num_workers": 4}),
        Recommendation("differs", "t", "w", "f", 1.1, overrides={"num_workers": 3, "persistent_workers": True}),
        Recommendation("bad", "t", "w", "f", 1.1, overrides={"workers": 3}),
        Recommendation("manual", "t", "w", "f", None),
    ]
    lines: list[str] = []
    ranked, info = verify_fixes(str(tmp_path / "train.py"), args=["data"], recommendations=recs, steps=5,
                                warmup=1, max_seconds=1.0, startup_margin_s=1.0, progress=lines.append)
    assert [r["fix"] for r in info["runs"]] == ["baseline", "slower", "crash", "hang", "faster", "differs",
                                               "baseline"]
    gains = {r.id: r.measured_gain for r in ranked}
    assert gains == {"faster": 4.0, "differs": 3.0, "hang": None, "crash": None, "bad": None, "manual": None,
                     "slower": 0.5}
    # by measured gain, else expected gain; then no estimate; the measured slowdown last
    assert [r.id for r in ranked] == ["faster", "differs", "crash", "hang", "bad", "manual", "slower"]
    assert info["baseline_samples_per_s"] == [100.0, 100.0] and info["baseline_drift"] == [1.0]
    faster = info["gains"]["faster"]
    assert {k: faster[k] for k in ("median", "min", "max", "measured_repeats", "error")} == {
        "median": 4.0, "min": 4.0, "max": 4.0, "measured_repeats": 1, "error": None}
    # one pair, the baselines agreeing: the prior's spread alone (+-25 % at 3 degrees of freedom) decides 4x
    assert faster["decision"]["verdict"] == "faster" and faster["decision"]["low"] > 3.0
    assert faster["trains_same"] is True and faster["trains_differently"] is None
    assert faster["loss"]["steps"] == [6, 9] and faster["loss"]["fix"] == pytest.approx(1.635)
    assert info["gains"]["slower"]["decision"]["verdict"] == "slower"
    differs = info["gains"]["differs"]
    assert differs["decision"]["verdict"] == "faster" and differs["trains_same"] is False
    assert differs["trains_differently"].startswith("loss 2.635 with it against the baselines' 1.635 over steps 6-9")
    assert info["set"]["ids"] == ["faster"]  # faster but training differently: left out of the set
    assert info["runs"][0]["loss"] == pytest.approx(1.635) and len(info["runs"][0]["losses"]) == 10
    assert "fell over" in info["gains"]["crash"]["error"]
    assert "timed out" in info["gains"]["hang"]["error"] and "stuck" in info["runs"][3]["error"]
    assert "fell over" in info["runs"][2]["output_tail"]
    assert "unknown override 'workers'" in info["gains"]["bad"]["error"]
    assert "manual" not in info["gains"]
    json.dumps(info)  # JSON-able, for Report.verify
    assert "faster: 400.0 samples/s" in lines[9] and "(loss 1.635)" in lines[9]
    said = lines[2 * 7:]  # after each run's two lines: each fix's verdict, then the set's
    assert said[0].startswith("verify: cannot tell") or said[0].startswith("verify: slower is slower than the "
                                                                            "baseline: 0.50x"), said
    assert [line for line in said if "differs is faster (3.00x" in line and "but trains differently: loss 2.635"
            in line], said
    assert said[-1] == "verify: together: one fix kept alone: the set is faster" and len(said) == 7
    children = [json.loads(line) for line in fake_child.read_text().splitlines()]
    assert len(children) == 7  # the invalid override never ran
    assert len({(json.dumps(c["env"]), c["cwd"]) for c in children}) == 1  # the overrides are the only difference


@pytest.mark.skipif(os.name != "posix", reason="a /bin/sh stand-in for the child interpreter")
def test_verify_fixes_repeats_take_the_median(fake_child: Path, tmp_path: Path) -> None:
    recs = [Recommendation("faster", "t", "w", "f", 1.2, overrides={"num_workers": 2})]
    ranked, info = verify_fixes(str(tmp_path / "train.py"), recommendations=recs, steps=5, warmup=1,
                                max_seconds=5.0, repeats=2)
    assert [r["fix"] for r in info["runs"]] == ["baseline", "faster", "baseline"] * 2
    assert [r["repeat"] for r in info["runs"]] == [0, 0, 0, 1, 1, 1]
    assert ranked[0].measured_gain == 2.0 and info["gains"]["faster"]["measured_repeats"] == 2


def test_verify_fixes_without_injectable_fixes_runs_nothing(tmp_path: Path) -> None:
    recs = [Recommendation("manual", "t", "w", "f", None), Recommendation("amp", "t", "w", "f", 1.5)]
    ranked, info = verify_fixes(str(tmp_path / "train.py"), recommendations=recs, steps=5, warmup=1)
    assert [r.id for r in ranked] == ["amp", "manual"]
    assert info["runs"] == [] and "nothing was re-run" in info["note"]
    with pytest.raises(ValueError, match="repeats"):
        verify_fixes("x.py", recommendations=recs, repeats=0)
