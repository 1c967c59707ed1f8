"""Fixtures of the integration tests: 2-rank jobs under the real torchrun (gloo on loopback)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping

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
