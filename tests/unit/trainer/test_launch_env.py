"""How a process was launched: SLURM steps without torchrun are refused, and torchrun's LOCAL_RANK picks the GPU.

`torch.cuda` is faked where the GPU path has no CPU twin: is_available, device_count and current_device, as torch
answers them on a machine with that many GPUs."""

from __future__ import annotations

import pytest
import torch

from trainfast.device import resolve_device
from trainfast.trainer.distributed import check_launch, dist_info

SRUN_4 = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0",
          "SLURM_PROCID": "2", "SLURM_LOCALID": "2"}
SBATCH_4 = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}  # no step
TORCHRUN_2 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_srun_of_several_tasks_without_torchrun_is_refused() -> None:
    with pytest.raises(ValueError) as info:  # the Trainer raises it as a ConfigError
        dist_info(SRUN_4)
    message = str(info.value)
    assert message.startswith("this process is task 2 of 4 that srun started (SLURM_STEP_NUM_TASKS=4, "
                              "SLURM_PROCID=2), but RANK and WORLD_SIZE are not set")
    assert "srun --ntasks-per-node=1 torchrun" in message and "--nproc-per-node=G" in message
    assert "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT" in message


@pytest.mark.parametrize("env", [
    pytest.param(SBATCH_4, id="python run directly in an sbatch script with --ntasks=4"),
    pytest.param(SBATCH_4 | {"SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_ID": "0"}, id="srun --ntasks=1"),
    pytest.param(SRUN_4 | {"RANK": "2", "WORLD_SIZE": "8", "LOCAL_RANK": "0"}, id="torchrun started by srun"),
    pytest.param({}, id="no SLURM"),
])
def test_single_processes_and_torchrun_are_not_refused(env: dict[str, str]) -> None:
    check_launch(env)
    info = dist_info(env)
    assert info.world_size == int(env.get("WORLD_SIZE", 1))


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return monkeypatch


@pytest.mark.parametrize(("spec", "env", "expected"), [
    ("cuda", TORCHRUN_2, "cuda:1"),  # every rank on GPU 0 otherwise
    ("auto", TORCHRUN_2, "cuda:1"),
    ("cuda", {}, "cuda:0"),
    ("cuda", {"LOCAL_RANK": "1", "WORLD_SIZE": "1"}, "cuda:0"),  # one process: the current GPU, as before
    ("cuda:0", TORCHRUN_2, "cuda:0"),  # an explicit index is kept (each rank may see only its own GPU)
    ("cpu", TORCHRUN_2, "cpu"),
])
def test_cuda_under_torchrun_is_the_local_ranks_gpu(two_gpus: pytest.MonkeyPatch, spec: str, env: dict[str, str],
                                                    expected: str) -> None:
    assert resolve_device(spec, env) == torch.device(expected)


@pytest.mark.parametrize("spec", ["auto", "cuda"])
def test_a_local_rank_beyond_the_visible_gpus_names_it_and_the_fix(two_gpus: pytest.MonkeyPatch, spec: str) -> None:
    env = TORCHRUN_2 | {"LOCAL_RANK": "3", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
                        "CUDA_VISIBLE_DEVICES": "0,1"}  # 4 processes on a machine with 2 GPUs
    with pytest.raises(ValueError) as info:
        resolve_device(spec, env)
    assert str(info.value) == (
        f"device={spec!r} means cuda:3 under torchrun (LOCAL_RANK=3), but this process sees 2 CUDA device(s) "
        "(CUDA_VISIBLE_DEVICES=0,1). Start at most 2 process(es) per node (torchrun --nproc-per-node=2) or make "
        "more GPUs visible (CUDA_VISIBLE_DEVICES); if each process is given only its own GPU, use device='cuda:0'")


def test_an_index_beyond_the_visible_gpus(two_gpus: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"^device='cuda:2' but only 2 CUDA device\(s\) are visible "
                                         r"\(CUDA_VISIBLE_DEVICES=unset\); use an index below 2, or 'cuda' / 'auto'$"):
        resolve_device("cuda:2", {})


def test_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", TORCHRUN_2) == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda", TORCHRUN_2)


def test_a_process_group_the_script_initialised_itself_is_taken_as_it_is() -> None:
    """A script that maps SLURM's variables itself and calls init_process_group(rank=..., world_size=...) is no
    uncoordinated copy: its group's rank and size are the run's."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        info = dist_info(SRUN_4)  # srun's variables, no RANK: refused without the group
    finally:
        dist.destroy_process_group()
    assert (info.rank, info.world_size, info.local_rank) == (0, 1, 2)
