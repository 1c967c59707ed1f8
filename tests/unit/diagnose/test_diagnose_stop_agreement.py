"""The ranks of a torchrun job stop the doctor at the same step (timeline.py's StopAgreement, runner.py's StoreStop
on a real TCPStore, as torchrun's agent hosts it): whichever rank's deadline, step count or SIGALRM asks first."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from trainfast.diagnose.capture import script
from trainfast.diagnose.capture.stop import STOP_CHECK_EVERY, StoreStop, launched_ranks, rank_agreement
from trainfast.diagnose.capture.timeline import StopMeasuring, Timeline
from trainfast.diagnose.run import doctor as runner

OPTIMIZER = object()


def client(server: Any, prefix: str = "trainfast/doctor/attempt_0/run_0/") -> Callable[[], Any]:
    def connect() -> Any:
        store = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=10))
        return dist.PrefixStore(prefix, store)
    return connect


def rank(server: Any, index: int, *, steps: int | None = None) -> Timeline:
    tl = Timeline(warmup_steps=2, max_steps=steps)
    tl.stop_when_done = True
    tl.agreement = StoreStop(client(server), index)
    return tl


def one_step(tl: Timeline, clock: list[float]) -> None:
    """An iteration of a loader-fed loop: its batch (which closes the step before), then its optimizer step."""
    tl.fetched(clock[0], clock[0] + 0.001, 8)
    tl.optimizer_step(OPTIMIZER)


def lockstep(ranks: list[Timeline], clock: list[float], *, steps: int = 200,
             before: Callable[[int], None] = lambda step: None) -> dict[int, tuple[int, str]]:
    """Run the ranks' iterations interleaved as DDP keeps them (the last one a step ahead); the closed step and
    reason each stopped at."""
    stopped: dict[int, tuple[int, str]] = {}
    for step in range(steps):
        before(step)
        for index in reversed(range(len(ranks))):  # the last rank runs each step first: one ahead
            if index in stopped:
                continue
            clock[0] += 0.01
            try:
                one_step(ranks[index], clock)
            except StopMeasuring as stop:
                stopped[index] = (ranks[index].closed_steps, stop.reason)
        if len(stopped) == len(ranks):
            break
    return stopped


def test_one_ranks_deadline_stops_every_rank_at_the_same_step(server: Any, clock: list[float]) -> None:
    a, b = rank(server, 0), rank(server, 1)

    def deadline(step: int) -> None:
        if step == 20:
            a.deadline = clock[0]  # rank 0's budget runs out; rank 1's never does
    stopped = lockstep([a, b], clock, before=deadline)
    assert stopped[0] == stopped[1]
    step, reason = stopped[0]
    assert reason == "budget" and 20 + STOP_CHECK_EVERY <= step <= 20 + STOP_CHECK_EVERY + 4
    assert [tl.agreement.asked_by for tl in (a, b) if isinstance(tl.agreement, StoreStop)] == [0, 0]


def test_ranks_that_would_measure_different_step_counts_stop_together(server: Any, clock: list[float]) -> None:
    """A rank with an extra phase (the thread probe) wants more steps than the other: the first to ask wins."""
    a, b = rank(server, 0, steps=5), rank(server, 1, steps=12)
    stopped = lockstep([a, b], clock)
    # rank 0 asked when it closed its last measured step (warm-up 2 + 5 steps)
    assert stopped[0] == stopped[1] == (2 + 5 + STOP_CHECK_EVERY + 3, "steps")
    assert len(a.records) == 5 and len(b.records) == 12  # each measured what it had before the agreed step


def test_the_stop_is_read_even_by_a_rank_that_checked_just_before_it_was_proposed(server: Any,
                                                                                 clock: list[float]) -> None:
    for offset in range(STOP_CHECK_EVERY):  # the proposal falls at every point of the readers' check cycle
        prefix = f"offset_{offset}/"
        a, b = Timeline(warmup_steps=0), Timeline(warmup_steps=0)
        a.agreement, b.agreement = StoreStop(client(server, prefix), 0), StoreStop(client(server, prefix), 1)

        def deadline(step: int, a: Timeline = a, offset: int = offset) -> None:
            if step == 3 * STOP_CHECK_EVERY + offset:
                a.deadline = clock[0]
        stopped = lockstep([a, b], clock, before=deadline)
        assert stopped[0] == stopped[1], offset


def test_a_rank_without_the_store_stops_alone_as_before(clock: list[float],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    def unreachable() -> Any:
        raise dist.DistStoreError("connect() timed out")
    tl = Timeline(warmup_steps=0)
    tl.agreement = StoreStop(unreachable, 1)
    with caplog.at_level(logging.WARNING, logger="trainfast.diagnose"):
        one_step(tl, clock)
        tl.deadline = clock[0]
        clock[0] += 0.01
        with pytest.raises(StopMeasuring, match="budget"):
            one_step(tl, clock)
    assert "rank 1 cannot use torchrun's store (DistStoreError: connect() timed out)" in caplog.text


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs SIGALRM")
def test_sigalrm_under_an_agreement_proposes_then_stops_alone_when_stuck(server: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    tl = Timeline(warmup_steps=0)
    tl.agreement = StoreStop(client(server), 1)
    monkeypatch.setattr(script, "STUCK_GRACE_S", 0.3)
    started = time.monotonic()
    with pytest.raises(StopMeasuring, match="budget"), script.alarm(0.05, tl):
        time.sleep(5)  # stuck: no step boundary comes
    seconds = time.monotonic() - started
    assert tl.stop_at == (STOP_CHECK_EVERY + 3, "budget")  # proposed to the other ranks at the first alarm...
    assert 0.3 <= seconds < 2  # ...and this rank stopped alone after the grace period
    reader = StoreStop(client(server), 0)
    assert reader.agreed() == (STOP_CHECK_EVERY + 3, "budget") and reader.asked_by == 1


@pytest.mark.parametrize(("env", "ranks"), [
    ({}, 0),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, 0),  # by hand: alone
    ({"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "x"}, 1),  # torchrun --nproc-per-node 1
    ({"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "n1", "MASTER_PORT": "1"}, 4),  # another launcher
    ({"WORLD_SIZE": "two"}, 0),
])
def test_launched_ranks(env: dict[str, str], ranks: int) -> None:
    assert launched_ranks(env) == ranks


def test_no_agreement_for_a_single_process_or_without_a_store_address(caplog: pytest.LogCaptureFixture) -> None:
    assert rank_agreement({}) is None
    assert rank_agreement({"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "x"}) is None
    with caplog.at_level(logging.WARNING, logger="trainfast.diagnose"):
        assert rank_agreement({"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}) is None
    assert "2 ranks but no store" in caplog.text and "MASTER_ADDR" in caplog.text


def test_agreement_on_torchruns_agent_store(server: Any) -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(server.port), "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "3"}
    agreement = rank_agreement(env)
    assert agreement is not None and agreement.propose(40, "steps") == (40, "steps")
    assert [k for k in server.list_keys() if k.endswith("/stop")] == [k for k in server.list_keys()
                                                                       if k.startswith("trainfast/doctor/attempt_3/")]


def test_gains_are_timed_on_a_replay_not_on_extra_steps_under_an_agreement(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, server: Any) -> None:
    """Under torchrun the candidate fixes are timed on a copy of the model (no collective in it), never on extra
    steps some ranks would take and others not: the measured steps and the agreed stop are as without them."""
    monkeypatch.setattr(runner, "rank_agreement", lambda **_: StoreStop(client(server), 0))
    script = tmp_path / "loop.py"
    script.write_text("import torch\nm = torch.nn.Linear(4, 2)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "for _ in range(40):\n    m(torch.randn(8, 4)).sum().backward()\n    opt.step()\n"
                      "    opt.zero_grad()\n")
    run = runner.run_doctor(str(script), steps=5, warmup=1)
    report = run.report.to_json()
    assert report["steps_measured"] == 5 and report["script"]["outcome"].startswith("stopped after")
    assert report["observed"]["trials"]["model"] == "Linear"
