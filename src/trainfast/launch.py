"""The launch environment: how many processes the launcher started, which one this is, and the CPUs each may use.

This module is the only place that reads the launcher's variables (torchrun's RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE and TORCHELASTIC_RESTART_COUNT; SLURM's where srun started the processes). Everything else asks
`launch_env()`. A new launcher's variables (SLURM's, MPI's, ...) are added here, and nowhere else. Setting the
variables (to start child processes) is not reading them, and may happen anywhere.

A value that cannot be meant (RANK="abc", WORLD_SIZE="0", RANK >= WORLD_SIZE) raises ValueError naming the variable,
its value and what is valid: training on with it would shard the data wrongly, or leave a rank waiting for peers
that do not exist.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from trainfast.host import available_cpus

TORCHRUN_VARS = ("RANK", "WORLD_SIZE")  # set by torchrun in every process it starts
LAUNCHED_BY_HAND = ("set both as torchrun does (RANK from 0 to WORLD_SIZE - 1 in each process), or neither for a "
                    "single process")


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the job: 0 of 1 for a process on its own."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1  # processes on this machine, sharing its CPUs
    gpu: int | None = None  # LOCAL_RANK when it is set: the GPU a launcher (or the user) gave this process

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that logs, prints and writes the job's files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def cpus_per_process(self, machine_cpus: int | None = None) -> int:
        """This process's share of the machine's usable CPUs (`machine_cpus`, default `available_cpus()`): the
        ranks on one machine share it, so each gets 1/LOCAL_WORLD_SIZE of it, and at least one."""
        cpus = available_cpus() if machine_cpus is None else machine_cpus
        return max(1, cpus // self.local_world_size)


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """The launch environment in `environ` (default `os.environ`): torchrun's variables, each defaulting to a single
    process's value when unset. ValueError for a value that is no integer, out of range, or inconsistent."""
    env = os.environ if environ is None else environ
    rank = _int_var(env, "RANK", 0, minimum=0, meaning="this process's rank")
    local_rank = _int_var(env, "LOCAL_RANK", 0, minimum=0, meaning="this process's rank on its machine")
    world_size = _int_var(env, "WORLD_SIZE", 1, minimum=1, meaning="the number of processes in the job")
    local_world_size = _int_var(env, "LOCAL_WORLD_SIZE", 1, minimum=1,
                                meaning="the number of processes on this machine")
    if rank >= world_size:
        shown = f"WORLD_SIZE={world_size}" if "WORLD_SIZE" in env else "WORLD_SIZE unset (1 process)"
        raise ValueError(f"RANK={rank} is not valid with {shown}: a rank runs from 0 to WORLD_SIZE - 1; "
                         + LAUNCHED_BY_HAND)
    # LOCAL_RANK alone (set by hand to pick a GPU) says nothing about how many processes share the machine
    if "LOCAL_WORLD_SIZE" in env and local_rank >= local_world_size:
        raise ValueError(f"LOCAL_RANK={local_rank} is not valid with LOCAL_WORLD_SIZE={local_world_size}: a local "
                         "rank runs from 0 to LOCAL_WORLD_SIZE - 1; set both as torchrun does, or unset "
                         "LOCAL_WORLD_SIZE")
    if "LOCAL_WORLD_SIZE" in env and "WORLD_SIZE" in env and local_world_size > world_size:
        raise ValueError(f"LOCAL_WORLD_SIZE={local_world_size} is not valid with WORLD_SIZE={world_size}: one "
                         "machine runs at most all the job's processes; set LOCAL_WORLD_SIZE to the processes on "
                         "this machine (torchrun's --nproc-per-node)")
    return LaunchEnv(rank=rank, local_rank=local_rank, world_size=world_size, local_world_size=local_world_size,
                     gpu=local_rank if "LOCAL_RANK" in env else None)


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """torchrun's attempt number (TORCHELASTIC_RESTART_COUNT): 0 on the first attempt and without torchrun."""
    env = os.environ if environ is None else environ
    return _int_var(env, "TORCHELASTIC_RESTART_COUNT", 0, minimum=0, meaning="torchrun's restart count")


def own_group_local_rank(environ: Mapping[str, str] | None = None) -> int:
    """The local rank of a process whose script initialised its process group itself: LOCAL_RANK, else SLURM's
    SLURM_LOCALID (a script mapping srun's variables), else 0."""
    env = os.environ if environ is None else environ
    name = "LOCAL_RANK" if "LOCAL_RANK" in env else "SLURM_LOCALID"
    return _int_var(env, name, 0, minimum=0, meaning="this process's rank on its machine")


def check_launch(environ: Mapping[str, str] | None = None) -> None:
    """Refuse an `srun` step of several tasks that torchrun did not start: ValueError saying how to launch (the
    Trainer raises it as a ConfigError).

    The rule: srun sets SLURM_STEP_NUM_TASKS in every task of a step; torchrun sets RANK and WORLD_SIZE in every
    process it starts. More than one task in the step and neither variable set means each task would train on its
    own. A script run directly in an sbatch or salloc shell is no step (SLURM_NTASKS may say 4 there, but only this
    one process runs) and neither is a one-task step (`srun --pty bash`): both train as one process.
    """
    env = os.environ if environ is None else environ
    tasks = env.get("SLURM_STEP_NUM_TASKS", "1")
    if not tasks.isdigit() or int(tasks) <= 1 or any(name in env for name in TORCHRUN_VARS):
        return
    procid = env.get("SLURM_PROCID", "?")
    raise ValueError(
        f"this process is task {procid} of {tasks} that srun started (SLURM_STEP_NUM_TASKS={tasks}, SLURM_PROCID="
        f"{procid}), but RANK and WORLD_SIZE are not set: each task would train the whole model on its own into the "
        "same checkpoint folder. Launch one torchrun per node, which starts one process per GPU: "
        "`srun --ntasks-per-node=1 torchrun --nnodes=$SLURM_NNODES --nproc-per-node=G "
        "--rdzv-backend=c10d --rdzv-endpoint=$(scontrol show hostnames | head -n1):29500 train.py` "
        "(or `-m trainfast train ...`); or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in each "
        "task yourself; or, for one process, run the script without srun or with `srun --ntasks=1`")


def _int_var(env: Mapping[str, str], name: str, default: int, *, minimum: int, meaning: str) -> int:
    """`env[name]` as an integer >= `minimum` (`default` when unset); ValueError naming it, its value and the fix."""
    text = env.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(f"{name}={text!r} in the environment is not valid; use an integer >= {minimum} ({meaning}), "
                         "as the launcher sets it, or unset it for a single process")
    return value
