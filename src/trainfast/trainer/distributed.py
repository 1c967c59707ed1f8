"""Data-parallel training under torchrun: the environment it sets, the process group, collective helpers.

trainfast has no launcher of its own: `torchrun --nproc-per-node=N -m trainfast train ...` (or any script
calling `Trainer.fit`) starts one process per device, and the Trainer finds RANK, LOCAL_RANK and
WORLD_SIZE in the environment. nccl on CUDA, gloo on the CPU.

Elastic restarts (`--max-restarts`): torchrun reuses one store across attempts, and on gloo the peers'
addresses from the failed attempt are still in it, so a restarted worker connects to a process that no
longer exists. Every attempt therefore gets its own key prefix, from TORCHELASTIC_RESTART_COUNT. Within an
attempt the store also outlives a process group: a later `fit` in the same process would find the earlier
group's keys under torch's own names (gloo: the peers' old addresses, and 2 ranks fitting 4 times in a row hung
in 3 runs of 3; nccl: the old unique id), so every group the process creates takes the next number in the prefix
too. Every rank creates its groups in the same order, so the numbers match.

SLURM without torchrun: `srun python train.py` starts SLURM_STEP_NUM_TASKS copies of the script with SLURM's
variables but no RANK / WORLD_SIZE; each would train alone into the same checkpoint folder. `check_launch`
(trainfast.launch, where every launch variable is read) refuses that instead of guessing a rendezvous address.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainfast.launch import check_launch, launch_env, own_group_local_rank, restart_count

log = logging.getLogger("trainfast")
TIMEOUT = timedelta(minutes=10)  # a collective that waits longer than this means a peer is gone
RELEASE_S = 0.05  # see process_group: time for the collective threads to let go of Python's tensors
_groups_created = itertools.count()  # process groups this process created: their store prefixes


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    restart: int = 0  # torchrun's attempt number (0 on the first)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def dist_info(env: Mapping[str, str] | None = None) -> DistInfo:
    """The launch environment (`launch_env`: all defaults without torchrun), or the process group the user already
    initialised; ValueError for a launch that is no torchrun's but starts several copies (`check_launch`), or for a
    malformed launch variable."""
    restart = restart_count(env)
    if dist_initialized():  # the user's own set-up (e.g. from SLURM's variables): its rank and size, as fit uses it
        return DistInfo(rank=dist.get_rank(), local_rank=own_group_local_rank(env),
                        world_size=dist.get_world_size(), restart=restart)
    check_launch(env)
    launch = launch_env(env)
    return DistInfo(rank=launch.rank, local_rank=launch.local_rank, world_size=launch.world_size, restart=restart)


def _store(info: DistInfo, group: int) -> Any:
    """The rendezvous store of this process's `group`-th process group, its keys apart from every other's."""
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent runs the server
    base = dist.TCPStore(host, port, info.world_size, is_master=not agent_hosts_it and info.is_main,  # type: ignore[attr-defined]
                         timeout=TIMEOUT)
    return dist.PrefixStore(f"trainfast/attempt_{info.restart}/group_{group}", base)  # type: ignore[attr-defined]


@contextmanager
def process_group(info: DistInfo, device: torch.device) -> Iterator[bool]:
    """Initialise the default process group for the block (unless the caller already did) and destroy it
    after; yields whether training is distributed."""
    if not info.enabled:
        yield False
        return
    if dist.is_initialized():  # the user's own set-up: use it, leave it
        yield True
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = _store(info, next(_groups_created))
    dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.world_size, timeout=TIMEOUT)
    log.info("distributed: rank %d of %d (%s, attempt %d)", info.rank, info.world_size, backend, info.restart)
    try:
        yield True
    finally:
        # A gloo worker thread releases the last collective's tensors after that collective returns, and needs
        # the GIL to do so. If the group is destroyed before (here, or later by DDP's reducer, which keeps it),
        # its destructor joins that thread while holding the GIL: a deadlock, seen in ~1 of 7 2-rank runs.
        # Sleeping hands the GIL over; the threads are idle from then on.
        time.sleep(RELEASE_S)
        dist.destroy_process_group()


def dist_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_sum(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sum over all ranks (a sync: call it at log points only)."""
    if not dist_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return [float(v) for v in t.tolist()]


def all_max(values: list[float], device: torch.device) -> list[float]:
    """Element-wise max over all ranks: the values every rank then decides on alike (an A/B's step times, flags)."""
    if not dist_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.tolist()]


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if it is True on any: all ranks take the same decision at the same step."""
    if not dist_initialized():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def agree_on_stop(requested: bool, steps: int, device: torch.device, status: int = 1) -> tuple[bool, int, int]:
    """(any rank requested a stop, the smallest `steps` any rank proposed, the largest `status` of any rank): one
    all-reduce of three numbers."""
    if not dist_initialized():
        return requested, steps, status
    t = torch.tensor([1.0 if requested else 0.0, -float(steps), float(status)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the max of -steps is -(the smallest)
    flag, neg_steps, worst = t.tolist()
    return flag > 0, int(-neg_steps), int(worst)


def gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (one entry without a process group)."""
    if not dist_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if dist_initialized():
        dist.barrier()


def side_group() -> Any:
    """A new process group of every rank on gloo (collective: every rank calls it, in the same order), for collectives
    issued from another thread than training's, such as a background checkpoint write's: two threads issuing
    collectives on one group would pair one rank's with another's in whichever order each thread came."""
    return dist.new_group(backend="gloo", timeout=TIMEOUT)
