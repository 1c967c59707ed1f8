"""attempts.py: each rank's record of its attempt on a real TCPStore (the agent's, hosted here), the steps and
seconds a restart trains again, and the record a SIGTERM leaves."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from trainfast.diagnose.capture.attempts import BEAT_S, KEY, AttemptRecord, agent_store, lost_progress, restarts_left
from trainfast.diagnose.capture.ledger import Ledger
from trainfast.diagnose.records.ledger import Write
from trainfast.diagnose.show.text import lost_progress_line


@pytest.fixture
def store() -> Any:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)


def ledger_with_steps(n: int, *, start: float = 100.0, step_s: float = 0.1) -> Ledger:
    ledger = Ledger(process_start=start - 5.0)
    for i in range(n):
        t = start + i * step_s
        ledger.step(t, t + step_s, 0.0, 0.0, t, 8, opening=i == 0)
    ledger.steps_closed = lambda: len(ledger.step_end)
    return ledger


def record(store: Any, ledger: Ledger, *, attempt: int = 0, rank: int = 0, world: int = 2) -> AttemptRecord:
    return AttemptRecord(store, ledger, attempt=attempt, run=0, rank=rank, world_size=world)


def test_a_write_on_the_main_thread_keeps_the_steps_before_it_and_loses_the_time_after_its_end(store: Any) -> None:
    ledger = ledger_with_steps(30)  # steps end at 100.1, 100.2, ... 103.0
    ledger.wrote(Write("torch.save", start=102.05, end=102.25, bytes=10))  # after step 20 (ends 102.0)
    figures = record(store, ledger).figures(103.0, None)
    offset = figures["at"] - 103.0
    assert figures["steps"] == 30 and figures["checkpoint_steps"] == 20
    assert figures["checkpoint_at"] - offset == pytest.approx(102.25)
    assert figures["started"] - offset == pytest.approx(95.0) and figures["ended"] is None


def test_a_background_write_keeps_the_state_from_its_start_and_training_went_on(store: Any) -> None:
    ledger = ledger_with_steps(30)
    ledger.wrote(Write("torch.save", start=102.05, end=102.85, bytes=10, background=True))
    figures = record(store, ledger).figures(103.0, None)
    assert figures["checkpoint_steps"] == 20
    assert figures["checkpoint_at"] - (figures["at"] - 103.0) == pytest.approx(102.05)


def test_steps_the_ledger_kept_none_of_still_count_for_the_step_numbers(store: Any) -> None:
    """The ledger keeps no step before the first input it saw; the timeline's count is the script's."""
    ledger = ledger_with_steps(10)
    ledger.steps_closed = lambda: 11
    ledger.wrote(Write("torch.save", start=100.55, end=100.6, bytes=1))
    figures = record(store, ledger).figures(101.0, None)
    assert figures["steps"] == 11 and figures["checkpoint_steps"] == 6


def test_the_record_goes_on_the_store_once_a_second_and_at_the_step_after_a_write(store: Any) -> None:
    ledger = ledger_with_steps(0)
    ledger.steps_closed = lambda: len(ledger.step_end)
    rec = record(store, ledger, rank=1)
    key = KEY.format(attempt=0, run=0, rank=1)
    rec.start()
    try:
        now = time.perf_counter()
        ledger.step(now, now + 0.01, 0.0, 0.0, now, 8, opening=True)  # the first step beats
        assert json.loads(store.get(key))["steps"] == 1
        ledger.step(now + 0.01, now + 0.02, 0.0, 0.0, now + 0.01, 8, opening=False)
        assert json.loads(store.get(key))["steps"] == 1  # within BEAT_S: not written again
        ledger.wrote(Write("torch.save", start=now + 0.02, end=now + 0.03, bytes=1))
        ledger.step(now + 0.03, now + 0.04, 0.0, 0.0, now + 0.03, 8, opening=False)
        assert json.loads(store.get(key))["checkpoint_steps"] == 2
        ledger.step(now + BEAT_S, now + BEAT_S + 0.1, 0.0, 0.0, now + BEAT_S, 8, opening=False)
        assert json.loads(store.get(key))["steps"] == 4
    finally:
        rec.end("the script finished")
    assert json.loads(store.get(key))["ended"] == "the script finished"
    assert ledger.on_beat is None and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def put(store: Any, attempt: int, rank: int, **figures: Any) -> None:
    record = {"rank": rank, "world_size": 2, "checkpoint_steps": None, "checkpoint_at": None, "ended": None} | figures
    store.set(KEY.format(attempt=attempt, run=0, rank=rank), json.dumps(record))


def test_the_failed_attempt_lost_its_steps_since_the_checkpoint_any_rank_wrote(store: Any) -> None:
    # rank 0 writes the checkpoints, beat last at step 24; rank 1 crashed at step 25, 1000.5 s
    put(store, 0, 0, steps=24, checkpoint_steps=20, checkpoint_at=1000.0, at=1000.4, started=990.0)
    put(store, 0, 1, steps=25, at=1000.5, started=990.0, ended="the script crashed: RuntimeError: boom")
    lost = lost_progress(store, attempt=1, run=0, started=1003.5)
    assert lost is not None
    (first,) = lost["attempts"]
    assert first["exact"] and first["rank"] == 1 and first["steps"] == 25 and first["checkpoint_steps"] == 20
    assert first["steps_lost"] == 5 and first["seconds_lost"] == pytest.approx(0.5)
    assert first["restart_s"] == pytest.approx(3.0)
    assert lost["steps"] == 5 and lost["seconds"] == pytest.approx(0.5) and lost["restart_s"] == pytest.approx(3.0)
    words = lost_progress_line(lost)
    assert "5 step(s)" in words and "since its last checkpoint (step 20)" in words and "at least" not in words


def test_without_an_end_recorded_the_latest_beat_gives_lower_bounds(store: Any) -> None:
    put(store, 0, 0, steps=40, at=2000.0, started=1990.0)  # killed: no checkpoint, no end
    put(store, 1, 0, steps=7, at=2010.0, started=2004.0, ended="the script crashed: OSError: disk")
    lost = lost_progress(store, attempt=2, run=0, started=2012.0)
    assert lost is not None
    first, second = lost["attempts"]
    assert not first["exact"] and first["checkpoint_steps"] is None and first["steps_lost"] == 40
    assert first["seconds_lost"] == pytest.approx(10.0) and first["restart_s"] == pytest.approx(4.0)
    assert second["exact"] and second["restart_s"] == pytest.approx(2.0)
    assert "at least 40 step(s)" in lost_progress_line(lost)


def test_an_attempt_with_no_record_is_named_and_the_first_attempt_has_no_lost_progress(store: Any) -> None:
    lost = lost_progress(store, attempt=1, run=0, started=5.0)
    assert lost is not None and lost["attempts"] == [{"attempt": 0, "recorded": False}] and lost["steps"] == 0
    assert "no record" in lost_progress_line(lost)
    assert lost_progress(store, attempt=0, run=0, started=5.0) is None
    assert lost_progress(None, attempt=3, run=0, started=5.0) is None


def test_the_agent_store_is_used_only_where_torchrun_can_restart_the_job() -> None:
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    assert agent_store(env | {"TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RESTART_COUNT": "0"}) is None
    assert agent_store({"TORCHELASTIC_MAX_RESTARTS": "3"}) is None  # no agent store to outlive the attempts
    assert restarts_left({"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_RESTART_COUNT": "1"})
    assert not restarts_left({"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_RESTART_COUNT": "2"})


def test_sigterm_writes_the_record_then_ends_the_process_as_it_would_have(store: Any) -> None:
    """torchrun's agent stops the ranks that did not fail with SIGTERM: the record says so, and the process still
    dies of the signal."""
    code = textwrap.dedent(f"""
        import os, signal, time
        from datetime import timedelta
        import torch.distributed as dist
        from trainfast.diagnose.capture.attempts import AttemptRecord
        from trainfast.diagnose.capture.ledger import Ledger
        store = dist.TCPStore("127.0.0.1", {store.port}, is_master=False, timeout=timedelta(seconds=5))
        ledger = Ledger(process_start=time.perf_counter())
        ledger.steps_closed = lambda: 3
        AttemptRecord(store, ledger, attempt=0, run=0, rank=1, world_size=2).start()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
        print("not stopped")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == -signal.SIGTERM, done.stderr[-2000:]
    assert "not stopped" not in done.stdout
    figures = json.loads(store.get(KEY.format(attempt=0, run=0, rank=1)))
    assert figures["steps"] == 3 and figures["ended"].startswith("stopped by SIGTERM")
