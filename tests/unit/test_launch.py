"""The launch environment is read in one place, `trainfast.launch`: its defaults, torchrun's variables, malformed
values refused with a message naming them, each process's share of the CPUs; and no other module reads them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import trainfast
from trainfast import launch
from trainfast.launch import LaunchEnv, launch_env

TORCHRUN_4_OF_8 = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}


def test_without_a_launcher_this_is_a_single_process() -> None:
    env = launch_env({})
    assert env == LaunchEnv() == LaunchEnv(rank=0, local_rank=0, world_size=1, local_world_size=1)
    assert env.is_main and not env.distributed


def test_torchrun_s_variables() -> None:
    env = launch_env(TORCHRUN_4_OF_8)
    assert env == LaunchEnv(rank=5, local_rank=1, world_size=8, local_world_size=4, gpu=1)
    assert not env.is_main and env.distributed
    assert launch_env({"RANK": "0", "WORLD_SIZE": "2"}).is_main


def test_the_process_environment_is_read_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in TORCHRUN_4_OF_8.items():
        monkeypatch.setenv(name, value)
    assert launch_env() == LaunchEnv(rank=5, local_rank=1, world_size=8, local_world_size=4, gpu=1)
    for name in TORCHRUN_4_OF_8:
        monkeypatch.delenv(name)
    assert launch_env() == LaunchEnv()


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "abc"}, "RANK='abc' in the environment is not valid; use an integer >= 0 (this process's rank), as "
                      "the launcher sets it, or unset it for a single process"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1' in the environment is not valid; use an integer >= 0"),
    ({"LOCAL_RANK": "1.5"}, "LOCAL_RANK='1.5' in the environment is not valid; use an integer >= 0"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' in the environment is not valid; use an integer >= 1 (the number of "
                          "processes in the job)"),
    ({"WORLD_SIZE": ""}, "WORLD_SIZE='' in the environment is not valid; use an integer >= 1"),
    ({"LOCAL_WORLD_SIZE": "none"}, "LOCAL_WORLD_SIZE='none' in the environment is not valid; use an integer >= 1"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not valid with WORLD_SIZE=2: a rank runs from 0 to WORLD_SIZE - 1; "
                                       "set both as torchrun does"),
    ({"RANK": "3"}, "RANK=3 is not valid with WORLD_SIZE unset (1 process): a rank runs from 0 to WORLD_SIZE - 1"),
    ({"LOCAL_RANK": "4", "LOCAL_WORLD_SIZE": "4"}, "LOCAL_RANK=4 is not valid with LOCAL_WORLD_SIZE=4: a local rank "
                                                   "runs from 0 to LOCAL_WORLD_SIZE - 1"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE=4 is not valid with WORLD_SIZE=2"),
])
def test_malformed_values_are_refused_naming_the_variable_and_what_is_valid(env: dict[str, str],
                                                                           message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        launch_env(env)


def test_a_local_rank_set_alone_picks_a_gpu_and_is_no_error() -> None:
    assert launch_env({"LOCAL_RANK": "3"}) == LaunchEnv(local_rank=3, gpu=3)  # LOCAL_WORLD_SIZE unknown, not 1 process


@pytest.mark.parametrize(("machine", "local_world", "share"), [
    (16, "1", 16), (16, "4", 4), (16, "3", 5), (2, "8", 1), (1, "1", 1)])
def test_each_process_gets_its_share_of_the_machine_s_cpus(monkeypatch: pytest.MonkeyPatch, machine: int,
                                                           local_world: str, share: int) -> None:
    env = launch_env({"LOCAL_WORLD_SIZE": local_world})
    assert env.cpus_per_process(machine) == share
    monkeypatch.setattr(launch, "available_cpus", lambda: machine)
    assert env.cpus_per_process() == share


def test_restart_count_and_a_script_s_own_local_rank() -> None:
    assert launch.restart_count({}) == 0
    assert launch.restart_count({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    with pytest.raises(ValueError, match=r"^TORCHELASTIC_RESTART_COUNT='x' in the environment is not valid"):
        launch.restart_count({"TORCHELASTIC_RESTART_COUNT": "x"})
    assert launch.own_group_local_rank({}) == 0
    assert launch.own_group_local_rank({"SLURM_LOCALID": "3"}) == 3
    assert launch.own_group_local_rank({"SLURM_LOCALID": "3", "LOCAL_RANK": "1"}) == 1


# -------------------------------------------------------------------------------- no other module reads them

LAUNCH_VAR = r"""["'](?:LOCAL_)?(?:RANK|WORLD_SIZE)["']"""
READS = re.compile(
    rf"""\.get\(\s*{LAUNCH_VAR}"""  # environ.get("RANK"), env.get("WORLD_SIZE", "1")
    rf"""|getenv\(\s*{LAUNCH_VAR}"""  # os.getenv("LOCAL_RANK")
    rf"""|\[\s*{LAUNCH_VAR}\s*\](?!\s*=[^=])"""  # os.environ["RANK"], but not env["RANK"] = "0" (setting is fine)
)


def _readers() -> dict[str, list[str]]:
    root = Path(trainfast.__file__).parent
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if READS.search(line)]
        if lines and name != "launch.py":
            found[name] = lines
    return found


def test_the_pattern_finds_reads_and_not_writes() -> None:
    for read in ('int(os.environ.get("RANK", "0"))', "os.environ['WORLD_SIZE']", 'os.getenv("LOCAL_RANK")',
                 'env.get( "LOCAL_WORLD_SIZE")', 'if env["RANK"] == "0":'):
        assert READS.search(read), read
    for other in ('env["RANK"] = "0"', 'env = {"RANK": "0"}', "LOCAL_WORLD_SIZE={n} processes", 'get("RANKS")'):
        assert not READS.search(other), other


def test_only_trainfast_launch_reads_the_launch_environment() -> None:
    readers = _readers()
    assert readers == {}, ("read the launch environment through trainfast.launch.launch_env(), not os.environ: "
                           f"{readers}")
