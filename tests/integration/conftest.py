"""Fixtures of the integration tests: 2-rank jobs under the real torchrun (gloo on loopback), started by one agent
(`torchrun`) or by two, as a job on two machines starts (`two_agents`)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch
from torch.optim import optimizer as optimizer_module
from torch.utils.data import DataLoader

TORCHRUN_ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
Torchrun = Callable[..., "subprocess.CompletedProcess[str]"]


def run_torchrun(*args: str, timeout: float, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`torchrun --standalone --nproc-per-node=2 ARGS` in its own session. Past `timeout` the whole process group is
    killed and the test fails with the end of its output (a hang is a failed test, not a stuck suite; scripts that
    arm faulthandler have dumped each rank's stacks there by then)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args]
    proc = subprocess.Popen(cmd, env=os.environ | TORCHRUN_ENV | dict(env or {}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun {' '.join(args[:6])} ran past {timeout} s; its output ends:\n{stdout[-3000:]}\n"
                    f"{stderr[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.fixture(scope="session")
def torchrun() -> Torchrun:
    """`torchrun(*args, timeout=S, env=None)`: a 2-rank job, see `run_torchrun`."""
    return run_torchrun


@dataclass
class Interrupt:
    """For `run_two_agents`: send `signum` to the process group of agent `agent` (0 or 1, in start order) once `when`
    holds: a path that exists, or a text that either agent has printed (stdout or stderr). After the run,
    `sent_after_s` is when it was sent (seconds from the agents' start; None if never) and `ended_after_s` how long
    both agents took to end after it."""

    agent: int
    when: Path | str
    signum: signal.Signals = signal.SIGTERM
    sent_after_s: float | None = None
    ended_after_s: float | None = None


def _free_port() -> int:
    with socket.socket() as free:  # released for the first agent's rendezvous store to bind
        free.bind(("127.0.0.1", 0))
        return int(free.getsockname()[1])


def run_two_agents(*args: str, timeout: float, env: Mapping[str, str] | None = None,
                   interrupt: Interrupt | None = None,
                   ) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """A 2-rank job started as on two machines: two torchrun agents on localhost, `--nnodes 2 --nproc-per-node 1`,
    meeting in a c10d rendezvous (a free port, a fresh `--rdzv-id`; agent 0 hosts its store), each in its own session,
    each running ARGS. Which agent's worker is rank 0 is the rendezvous' choice (the lower pid: in practice agent 0,
    not always). `interrupt` signals one agent mid-run. Past `timeout` both agents and their workers are killed and
    the test fails with both outputs' tails (a hang is a failed test). Returns each agent's CompletedProcess, in
    start order."""
    endpoint, job = f"127.0.0.1:{_free_port()}", f"test-{uuid.uuid4().hex[:12]}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job}", "--max-restarts=0"]
    # agent 0 hosts the rendezvous store, as the endpoint's machine does (on one host both would race to bind it)
    cmds = [[*cmd, f"--rdzv-conf=is_host={host}", *args] for host in ("true", "false")]
    full_env = os.environ | TORCHRUN_ENV | dict(env or {})
    with tempfile.TemporaryDirectory(prefix="two-agents-") as folder:
        # files, not pipes: read while the agents run (`interrupt`), and nothing blocks on a full pipe
        logs = [(Path(folder) / f"agent{i}.out", Path(folder) / f"agent{i}.err") for i in (0, 1)]
        procs: list[subprocess.Popen[str]] = []

        def outputs() -> list[tuple[str, str]]:
            return [(out.read_text(errors="replace"), err.read_text(errors="replace")) for out, err in logs]

        started = time.monotonic()
        try:
            for (out, err), agent_cmd in zip(logs, cmds, strict=True):
                with out.open("w") as stdout, err.open("w") as stderr:
                    procs.append(subprocess.Popen(agent_cmd, env=full_env, stdout=stdout, stderr=stderr, text=True,
                                                  start_new_session=True))
            deadline = started + timeout
            while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
                if interrupt is not None and interrupt.sent_after_s is None and _holds(interrupt.when, outputs):
                    os.killpg(procs[interrupt.agent].pid, interrupt.signum)
                    interrupt.sent_after_s = time.monotonic() - started
                time.sleep(0.05)
            if any(proc.poll() is None for proc in procs):
                tails = "\n".join(f"--- agent {i} ({'running' if proc.poll() is None else proc.returncode}):\n"
                                  f"{out[-2000:]}\n{err[-5000:]}"
                                  for i, (proc, (out, err)) in enumerate(zip(procs, outputs(), strict=True)))
                pytest.fail(f"two torchrun agents, {' '.join(args[:6])}, ran past {timeout} s; their output ends:\n"
                            f"{tails}")
            if interrupt is not None and interrupt.sent_after_s is not None:
                interrupt.ended_after_s = time.monotonic() - started - interrupt.sent_after_s
            (out0, err0), (out1, err1) = outputs()
            return (subprocess.CompletedProcess(cmds[0], procs[0].returncode, out0, err0),
                    subprocess.CompletedProcess(cmds[1], procs[1].returncode, out1, err1))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    _kill_agent(proc)


def _kill_agent(agent: subprocess.Popen[str]) -> None:
    """SIGKILL an agent and everything under it: torchrun starts each worker in a session of its own, which the
    agent's process group does not reach (a worker left behind would sit in a collective for gloo's 30 minutes)."""
    try:
        below = psutil.Process(agent.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    os.killpg(agent.pid, signal.SIGKILL)
    for process in below:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    agent.wait()


def _holds(when: Path | str, outputs: Callable[[], list[tuple[str, str]]]) -> bool:
    if isinstance(when, Path):
        return when.exists()
    return any(when in out or when in err for out, err in outputs())


class TwoAgents:
    """The `two_agents` fixture: `two_agents(*args, timeout=S, env=None, interrupt=None)` runs `run_two_agents`;
    `two_agents.Interrupt(agent=0, when=path_or_text)` makes the `interrupt` (tests import nothing from here: the
    name `conftest` is ambiguous when several test folders are collected)."""

    Interrupt = Interrupt

    def __call__(self, *args: str, timeout: float, env: Mapping[str, str] | None = None,
                 interrupt: Interrupt | None = None,
                 ) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
        return run_two_agents(*args, timeout=timeout, env=env, interrupt=interrupt)


@pytest.fixture(scope="session")
def two_agents() -> TwoAgents:
    """A 2-rank job launched as on two machines, one torchrun agent each, on localhost; see `TwoAgents`."""
    return TwoAgents()


@pytest.fixture
def nothing_left_patched() -> Iterator[None]:
    """After the test (a doctor run in this process) the process looks exactly as before it: the loader, torch's
    tensor attributes and compile, sys.argv, sys.path, __main__, no optimizer hook left registered."""
    def snapshot() -> tuple[object, ...]:
        main = sys.modules.get("__main__")
        return (DataLoader.__iter__, dict(vars(torch.Tensor)), torch.compile, sys.argv[:], sys.path[:],
                dict(main.__dict__) if main is not None else None)
    before = snapshot()
    yield
    for name, a, b in zip(("DataLoader.__iter__", "Tensor attributes", "torch.compile", "sys.argv", "sys.path",
                           "__main__"), before, snapshot(), strict=True):
        assert a == b, f"{name} changed"
    assert not optimizer_module._global_optimizer_post_hooks
