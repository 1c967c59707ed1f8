"""The launch environment, read in this one place: rank, world size, local world size and the CPUs each process
may use. A new launcher's variables (e.g. SLURM's) are added here."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from trainfast.host import available_cpus


@dataclass(frozen=True)
class LaunchEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def cpus_per_process(self) -> int:
        """The usable CPUs divided among the processes on this machine (ranks share the machine)."""
        return max(1, available_cpus() // self.local_world_size)


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    env = os.environ if environ is None else environ
    return LaunchEnv(rank=int(env.get("RANK", "0")), local_rank=int(env.get("LOCAL_RANK", "0")),
                     world_size=int(env.get("WORLD_SIZE", "1")), local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")))
