"""FSDP's pieces that need no second rank: which modules get their own fully_shard, the "auto" strategy's figures,
the precision policies, the settings refused, and a sharded checkpoint's commit (one process, DCP without a process
group): complete or absent, never torn."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from trainfast.precision.policy import DeviceCaps, resolve_precision
from trainfast.trainer.config import ConfigError, TrainConfig
from trainfast.trainer.sharded_checkpoint import (
    TEMP_DIR_PREFIX,
    ShardedWrite,
    clean_stale_folders,
    load_into,
    load_trainer_state,
)
from trainfast.trainer.sharding import (
    choose_strategy,
    describe,
    local_bytes,
    mixed_precision,
    replicated_bytes,
    shard_blocks,
)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn, self.mlp = nn.Linear(width, width), nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                                                        nn.Linear(2 * width, width))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x + self.attn(x)))


class Transformer(nn.Module):
    """Blocks in a ModuleList one level down, an embedding and a head around them."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, width)
        self.body = nn.Module()
        self.body.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 50)


def test_the_repeated_blocks_are_sharded_not_the_layers_inside_them() -> None:
    model = Transformer()
    blocks = shard_blocks(model)
    # each Block's mlp repeats nn.Linear twice too, but the 4 Blocks hold more parameters: they are the blocks
    assert blocks == list(model.body.layers)
    assert describe(blocks, model) == "4 x Block + root"


def test_a_sequential_of_layers_shards_each_repeated_layer() -> None:
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    assert shard_blocks(model) == [model[0], model[2], model[4]]  # GELU holds no parameters


def test_without_repeats_the_large_children_are_sharded_by_size() -> None:
    model = nn.Module()
    model.big, model.small = nn.Linear(64, 64), nn.LayerNorm(64)  # 4160 vs 128 parameters (3% of them)
    model.conv = nn.Conv2d(3, 16, 3)  # 448 (9.6%): under BLOCK_SHARE, goes with the root
    assert shard_blocks(model) == [model.big]


def test_a_single_layer_is_sharded_at_the_root_only() -> None:
    model = nn.Linear(4, 4)
    assert shard_blocks(model) == []
    assert describe([], model) == "root only (Linear)"


def test_auto_keeps_ddp_when_the_state_fits_and_shards_when_any_rank_says_it_does_not() -> None:
    model = nn.Linear(256, 256)  # 65,792 parameters, 257 KiB in fp32
    optimizer = torch.optim.AdamW(model.parameters())
    assert replicated_bytes(model, optimizer) == 4 * 65_792 * 4  # weights, gradients, AdamW's two moments
    kept = choose_strategy("auto", model, optimizer, torch.device("cpu"), ranks_here=2, agree=lambda flag: flag)
    assert kept.name == "ddp"
    assert "parameters + gradients + optimizer state 2.0 MiB for the 2 ranks on this host vs" in kept.reason
    sharded = choose_strategy("auto", model, optimizer, torch.device("cpu"), ranks_here=2, agree=lambda flag: True)
    assert sharded.name == "fsdp" and "over 50% on this or another rank" in sharded.reason
    assert choose_strategy("fsdp", model, optimizer, torch.device("cpu"), ranks_here=2,
                           agree=lambda flag: False).name == "fsdp"


def test_bf16_gathers_in_bf16_and_reduces_in_fp32_and_fp16_is_refused() -> None:
    caps = DeviceCaps(device_type="cuda", capability=(8, 0), bf16=True)
    policy = mixed_precision(resolve_precision("bf16-mixed", caps))
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision(resolve_precision("32-true", caps)).param_dtype is None
    with pytest.raises(ValueError, match="bf16-mixed"):
        mixed_precision(resolve_precision("16-mixed", caps))


def test_config_refuses_an_unknown_strategy_and_fsdp_with_fp16() -> None:
    with pytest.raises(ConfigError, match=r"strategy='zero3' is not valid; choose one of: auto, ddp, fsdp"):
        TrainConfig(strategy="zero3")
    with pytest.raises(ConfigError, match=r"Use precision='bf16-mixed' \(no loss scaler\) or '32-true'"):
        TrainConfig(strategy="fsdp", precision="16-mixed")
    assert TrainConfig().strategy == "auto"


def test_a_sharded_checkpoint_is_in_place_only_once_committed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    last = tmp_path / "last.pt"

    def write(step: int, number: int) -> ShardedWrite:
        write = ShardedWrite(model, optimizer, {"step": step}, last, 2, None, number=number, group=None,
                             background=False)  # (the background write: tests/integration/test_fsdp.py)
        write.wait()
        assert write.error is None
        return write

    write(1, 1).commit()
    first = model[0].weight.detach().clone()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    write(2, 2).commit()
    assert load_trainer_state(tmp_path / "last.dcp")["step"] == 2
    assert load_trainer_state(tmp_path / "last.1.dcp")["step"] == 1
    write(3, 3)  # written, never agreed complete (the job died): not a checkpoint
    assert load_trainer_state(tmp_path / "last.dcp")["step"] == 2

    fresh = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    load_into(tmp_path / "last.1.dcp", fresh, fresh_optimizer)
    assert torch.equal(fresh[0].weight, first)
    assert local_bytes(fresh, fresh_optimizer) == local_bytes(model, optimizer)
    assert [p.name for p in clean_stale_folders(tmp_path)] == [f"{TEMP_DIR_PREFIX}last.dcp-3"]
