"""`ProgressReporter`: on a stream that is not a terminal, an INFO record on the "trainfast" logger every
`interval_s` (step/total, epoch, samples/s, data wait, loss, loss scale); on a terminal, a rich bar on stderr
refreshed every 0.25 s. Time is given explicitly (`now`), so nothing sleeps."""

from __future__ import annotations

import logging
import sys
import threading

import pytest

from trainfast.trainer.progress import ProgressReporter


@pytest.fixture
def records(trainfast_log: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    """The "trainfast" logger's records, each once: the package logger may or may not propagate to the root."""
    monkeypatch.setattr(logging.getLogger("trainfast"), "propagate", False)
    return trainfast_log


def still_running(before: set[threading.Thread]) -> list[str]:
    """Threads started since `before` that do not end within 2 s. rich's refresh thread is told to stop when the
    bar closes and ends on its own a moment later (Live.stop does not join it)."""
    started = [t for t in threading.enumerate() if t not in before]
    for thread in started:
        thread.join(timeout=2.0)
    return [t.name for t in started if t.is_alive()]


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trainfast"]


def log_reporter(*, interval_s: float = 10.0, total_steps: int | None = 100, epochs: int = 3,
                 enabled: bool = True) -> ProgressReporter:
    return ProgressReporter(enabled=enabled, total_steps=total_steps, interval_s=interval_s, epochs=epochs, tty=False)


def test_a_log_line_has_step_total_epoch_rate_wait_loss_and_scale(records: pytest.LogCaptureFixture,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with log_reporter() as bar:
        bar.loss, bar.loss_scale = 0.123456, 65536.0
        bar.show(10.0, step=40, epoch=1, samples_per_s=12345.6, wait_fraction=0.07)
    assert lines(records) == ["epoch 2/3 step 40/100 | 12,346 samples/s | data wait 7% | loss 0.1235 | scale 65536"]
    assert [r.levelno for r in records.records] == [logging.INFO]
    assert capsys.readouterr() == ("", "")  # a log record only: the logger's handlers decide where it goes


@pytest.mark.parametrize(
    ("loss", "scale", "total", "expected"),
    [
        (None, None, 100, "epoch 1/3 step 7/100 | 950 samples/s | data wait 50%"),  # no loss read yet
        (2.0, None, 100, "epoch 1/3 step 7/100 | 950 samples/s | data wait 50% | loss 2.0000"),  # no loss scaling
        (None, 1024.0, 100, "epoch 1/3 step 7/100 | 950 samples/s | data wait 50% | scale 1024"),
        (0.5, 1.5e6, 100, "epoch 1/3 step 7/100 | 950 samples/s | data wait 50% | loss 0.5000 | scale 1.5e+06"),
        (0.5, None, None, "epoch 1/3 step 7 | 950 samples/s | data wait 50% | loss 0.5000"),  # length unknown
        (0.5, None, 0, "epoch 1/3 step 7 | 950 samples/s | data wait 50% | loss 0.5000"),
    ],
)
def test_log_line_parts(records: pytest.LogCaptureFixture, loss: float | None, scale: float | None,
                        total: int | None, expected: str) -> None:
    with log_reporter(total_steps=total) as bar:
        bar.loss, bar.loss_scale = loss, scale
        bar.show(1.0, step=7, epoch=0, samples_per_s=950.0, wait_fraction=0.5)
    assert lines(records) == [expected]


def test_large_rates_are_grouped_and_rounded(records: pytest.LogCaptureFixture) -> None:
    with log_reporter(epochs=1) as bar:
        bar.show(1.0, step=1, epoch=0, samples_per_s=1_234_567.8, wait_fraction=0.0)
        bar.show(2.0, step=2, epoch=0, samples_per_s=0.4, wait_fraction=1.0)
    assert lines(records) == ["epoch 1/1 step 1/100 | 1,234,568 samples/s | data wait 0%",
                              "epoch 1/1 step 2/100 | 0 samples/s | data wait 100%"]


def test_due_first_one_interval_after_the_first_ask_then_one_interval_after_each_line() -> None:
    bar = log_reporter(interval_s=10.0)
    assert bar.interval_s == 10.0
    assert not bar.due(100.0)  # the first ask starts the clock: first line due at 110
    assert not bar.due(109.999)
    assert bar.due(110.0)
    assert bar.due(115.0)  # still due until a line is shown
    bar.show(115.0, step=1, epoch=0, samples_per_s=1.0, wait_fraction=0.0)
    assert not bar.due(124.9)  # the interval counts from the line shown, not from when it fell due
    assert bar.due(125.0)


def test_a_loop_logs_at_the_interval(records: pytest.LogCaptureFixture) -> None:
    """One step every 3 s for 40 s with a 10 s interval: lines at 12, 24 and 36 s (the first step that finds
    one due), not one per step."""
    shown: list[float] = []
    with log_reporter(interval_s=10.0, total_steps=14, epochs=1) as bar:
        for step in range(14):
            now = 3.0 * step
            if bar.due(now):
                bar.loss = float(step)
                bar.show(now, step=step, epoch=0, samples_per_s=100.0, wait_fraction=0.25)
                shown.append(now)
    assert shown == [12.0, 24.0, 36.0]
    assert lines(records) == [f"epoch 1/1 step {s}/14 | 100 samples/s | data wait 25% | loss {s}.0000"
                              for s in (4, 8, 12)]


def test_show_without_due_resets_the_interval() -> None:
    """The loop shows a line at each epoch end whatever `due` says; the next one comes an interval later."""
    bar = log_reporter(interval_s=5.0)
    bar.show(3.0, step=1, epoch=0, samples_per_s=1.0, wait_fraction=0.0)
    assert not bar.due(7.9)
    assert bar.due(8.0)


def test_a_zero_interval_is_due_at_every_step() -> None:
    bar = log_reporter(interval_s=0.0)
    assert bar.due(0.0)
    bar.show(0.0, step=1, epoch=0, samples_per_s=1.0, wait_fraction=0.0)
    assert bar.due(0.0) and bar.due(0.001)


def test_log_lines_read_a_fresh_loss_the_bar_does_not() -> None:
    assert log_reporter().wants_loss is True
    assert ProgressReporter(enabled=True, total_steps=1, interval_s=10.0, epochs=1, tty=True).wants_loss is False


@pytest.mark.parametrize("tty", [False, True])
def test_a_disabled_reporter_prints_nothing(tty: bool, records: pytest.LogCaptureFixture,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    threads = set(threading.enumerate())
    with ProgressReporter(enabled=False, total_steps=10, interval_s=0.0, epochs=1, tty=tty) as bar:
        assert set(threading.enumerate()) == threads  # no refresh thread
        for now in (0.0, 0.25, 1.0, 1e9):
            assert not bar.due(now)
        bar.loss, bar.loss_scale = 1.0, 2.0
        bar.show(5.0, step=3, epoch=0, samples_per_s=10.0, wait_fraction=0.5)
    assert lines(records) == []
    assert capsys.readouterr() == ("", "")


def test_tty_is_read_from_stderr_when_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal:
        def isatty(self) -> bool:
            return True

    class Pipe:
        def isatty(self) -> bool:
            return False

    monkeypatch.setattr(sys, "stderr", Pipe())
    piped = ProgressReporter(enabled=True, total_steps=1, interval_s=7.0, epochs=1)
    assert (piped.tty, piped.interval_s) == (False, 7.0)
    monkeypatch.setattr(sys, "stderr", Terminal())
    terminal = ProgressReporter(enabled=True, total_steps=1, interval_s=7.0, epochs=1)
    assert (terminal.tty, terminal.interval_s) == (True, 0.25)  # the bar refreshes every 0.25 s whatever asked


def test_the_bar_is_due_at_once_then_every_quarter_second() -> None:
    bar = ProgressReporter(enabled=True, total_steps=10, interval_s=10.0, epochs=1, tty=True)
    assert bar.due(0.0)
    bar.show(1.0, step=1, epoch=0, samples_per_s=1.0, wait_fraction=0.0)  # sets the next refresh
    assert not bar.due(1.2)
    assert bar.due(1.25)


def test_the_bar_draws_on_stderr_and_closes_cleanly(records: pytest.LogCaptureFixture,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    threads = set(threading.enumerate())
    with ProgressReporter(enabled=True, total_steps=10, interval_s=10.0, epochs=2, tty=True) as bar:
        bar.loss = 0.25
        bar.show(0.0, step=3, epoch=1, samples_per_s=1234.4, wait_fraction=0.07)
    assert still_running(threads) == []  # rich's refresh thread has stopped
    out, err = capsys.readouterr()
    assert out == ""
    assert "epoch 2/2" in err and "1,234 samples/s" in err  # the final frame, on stderr
    assert lines(records) == []  # the bar replaces the log lines
    bar.__exit__(None, None, None)  # closing twice is harmless


def test_the_bar_closes_when_training_raises(capsys: pytest.CaptureFixture[str]) -> None:
    threads = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="boom"), \
            ProgressReporter(enabled=True, total_steps=10, interval_s=10.0, epochs=1, tty=True) as bar:
        bar.show(0.0, step=1, epoch=0, samples_per_s=1.0, wait_fraction=0.0)
        raise RuntimeError("boom")  # the reporter does not swallow the error
    assert still_running(threads) == []
    assert capsys.readouterr().out == ""


def test_log_mode_enter_and_exit_leave_nothing_behind(records: pytest.LogCaptureFixture,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    threads = set(threading.enumerate())
    with log_reporter() as bar:
        assert set(threading.enumerate()) == threads
    bar.__exit__(None, None, None)
    assert lines(records) == [] and capsys.readouterr() == ("", "")
