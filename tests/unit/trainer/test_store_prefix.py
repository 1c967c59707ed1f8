"""Each process group a process creates rendezvouses under its own keys in torchrun's store, which outlives it.

A real TCPStore plays torchrun's agent store; only `init_process_group` is replaced, to keep the store it is given
(one process cannot be two ranks). The two-process run is tests/integration/test_ddp_fits_in_a_row.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from trainfast.trainer.distributed import DistInfo, process_group


def test_a_second_group_does_not_see_the_first_groups_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    stores: list[Any] = []

    def init_process_group(*args: Any, store: Any, **kwargs: Any) -> None:
        stores.append(store)

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *args, **kwargs: None)
    info = DistInfo(rank=0, local_rank=0, world_size=2)
    for _ in range(2):  # two fits in one process
        with process_group(info, torch.device("cpu")) as distributed:
            assert distributed
    first, second = stores
    first.set("0/cpu/rank_0", "the first group's address")  # what gloo would have left behind
    assert not second.check(["0/cpu/rank_0"])
