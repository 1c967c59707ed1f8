"""Fully sharded data parallelism (FSDP2, `torch.distributed.fsdp.fully_shard`) for a model too large for one device,
and the choice between it and DDP.

Under DDP every rank holds the whole model, its gradients and the optimizer's state; under FSDP each rank holds
1/world_size of each and gathers a block's parameters only while that block runs. `strategy="auto"` keeps DDP (no
gather per block: faster) while parameters + gradients + optimizer state fit the device with room
(`FIT_SHARE` of its free memory; on the CPU of the host's available memory, shared by the ranks on the host).

`fully_shard` goes on the model's repeated blocks (`shard_blocks`) and then on the root: each block's parameters are
one all-gather, freed after the block's forward and backward, and the root takes whatever no block holds. It
replaces each parameter by a sharded one (a DTensor) in place, so the optimizer, built over the originals, is pointed
at the new ones (`shard`) before its first step.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from trainfast.host import memory
from trainfast.precision.policy import PrecisionPolicy
from trainfast.trainer.checkpoint import METADATA_BYTES, estimate_checkpoint_bytes
from trainfast.trainer.config import FP16_REFUSED
from trainfast.units import format_bytes

if TYPE_CHECKING:  # imported where used: torch.distributed.fsdp costs every CLI start otherwise
    from torch.distributed.fsdp import MixedPrecisionPolicy

log = logging.getLogger("trainfast")
# DDP is kept while the replicated state takes at most this share of the free memory: activations, the loader's
# batches and the allocator's slack need the rest (activations alone often match the parameters' size).
FIT_SHARE = 0.5
# Without repeated blocks, a child of the root gets its own fully_shard when it holds at least this share of the
# parameters: smaller ones go with the root (an all-gather each would cost more in latency than it frees).
BLOCK_SHARE = 0.1


@dataclass(frozen=True)
class StrategyChoice:
    name: str  # "ddp" or "fsdp"
    reason: str


def shard_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules that get their own `fully_shard` before the root's, in the model's order.

    Repeated blocks first: among every module's direct children, the largest group of one class (2 or more, holding
    parameters) by parameter count, e.g. a transformer's `layers` ModuleList or a Sequential of identical layers.
    Without repeats, the root's children holding at least `BLOCK_SHARE` of the parameters. Otherwise none (the root
    alone)."""
    groups: dict[tuple[int, type], list[nn.Module]] = {}
    for parent in model.modules():
        for child in parent.children():
            if _params(child):
                groups.setdefault((id(parent), type(child)), []).append(child)
    repeated = [members for members in groups.values() if len(members) >= 2]
    if repeated:
        return max(repeated, key=lambda members: sum(_params(m) for m in members))  # first of equals: shallowest
    total = _params(model)
    return [child for child in model.children() if total and _params(child) >= BLOCK_SHARE * total]


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def replicated_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes each rank holds under DDP: parameters, their gradients (trained ones) and the optimizer's state. Before
    the first step an optimizer holds no state: counted as it will be, 2 copies per trained parameter for Adam-style
    optimizers (AdamW's two moments), 1 for SGD with momentum, 0 for plain SGD."""
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return estimate_checkpoint_bytes(model, optimizer) - METADATA_BYTES + trained


def free_bytes(device: torch.device) -> tuple[int | None, str]:
    """(free bytes, where) for the device: the GPU's free memory, or the host's available memory on the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free on {device}"
    return memory().available, "available host memory"


def choose_strategy(requested: str, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, *,
                    ranks_here: int, agree: Callable[[bool], bool]) -> StrategyChoice:
    """The strategy for a distributed fit: `requested` unless "auto"; "auto" is FSDP when the replicated state of
    the `ranks_here` ranks sharing this device's memory would take more than `FIT_SHARE` of it on any rank (`agree`:
    true on every rank if true on any, so all ranks choose alike), else DDP."""
    if requested != "auto":
        return StrategyChoice(requested, f"strategy={requested!r}")
    needed = replicated_bytes(model, optimizer) * (ranks_here if device.type == "cpu" else 1)
    free, where = free_bytes(device)
    too_big = agree(free is not None and needed > FIT_SHARE * free)
    figures = (f"parameters + gradients + optimizer state {format_bytes(needed)}"
               + (f" for the {ranks_here} ranks on this host" if device.type == "cpu" and ranks_here > 1 else "")
               + (f" vs {format_bytes(free)} {where} (an estimate: the optimizer's state counted before its first step)"
                  if free is not None else f" ({where} unknown)"))
    if too_big:
        return StrategyChoice("fsdp", f"auto: {figures}, over {FIT_SHARE:.0%} on this or another rank: sharded")
    return StrategyChoice("ddp", f"auto: {figures}, within {FIT_SHARE:.0%}: replicated (no all-gather per block)")


def mixed_precision(policy: PrecisionPolicy) -> MixedPrecisionPolicy:
    """FSDP's MixedPrecisionPolicy for a precision: for a mixed one its dtype (bf16) for the parameters in forward and
    backward, gradients reduced in fp32 (a sum of bf16 gradients over ranks loses their low bits); for fp32 none
    (the default policy). fp16 is refused (ValueError)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if policy.needs_scaler:
        raise ValueError(FP16_REFUSED)
    if policy.autocast_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=policy.autocast_dtype, reduce_dtype=torch.float32)


def shard(model: nn.Module, optimizer: torch.optim.Optimizer, policy: PrecisionPolicy) -> str:
    """`fully_shard` the blocks (`shard_blocks`) and the root, in place, over every rank of the default process group;
    the optimizer's parameter groups then hold the sharded parameters. Returns what was sharded, for the log.
    Parameters in channels_last are made contiguous first: fully_shard refuses them (torch 2.13).

    Raises ValueError for an optimizer that has already stepped (its state is the unsharded parameters')."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if optimizer.state:
        raise ValueError("strategy='fsdp' shards the parameters before the first step, but the optimizer given has "
                         "stepped already; pass an optimizer that has not stepped (or use strategy='ddp')")
    names = {id(p): name for name, p in model.named_parameters()}
    groups = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    mp = mixed_precision(policy)
    model.to(memory_format=torch.contiguous_format)  # type: ignore[call-overload]  # it shards no channels_last kernel
    blocks = shard_blocks(model)
    described = describe(blocks, model)  # before fully_shard renames the classes (FSDPBlock)
    if mp.param_dtype is not None:
        # BatchNorm keeps fp32 weights beside its fp32 running statistics (the CPU kernel refuses bf16 weights with
        # fp32 statistics): its own fully_shard in fp32, inputs cast up, outputs back to autocast's dtype
        norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and _params(m)]
        for norm in norms:
            fully_shard(norm, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
        if norms:
            described += f" ({len(norms)} BatchNorm layer(s) on their own, in fp32)"
    for block in blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    sharded = dict(model.named_parameters())
    for group, group_names in zip(optimizer.param_groups, groups, strict=True):
        group["params"] = [sharded[name] for name in group_names]
    return described


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(parameter bytes, optimizer state bytes) this rank holds: the local shards of sharded tensors."""
    def held(t: torch.Tensor) -> int:
        local = t.to_local() if hasattr(t, "to_local") else t
        return int(local.numel() * local.element_size())
    params = sum(held(p) for p in model.parameters())
    state = sum(held(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return params, state


def describe(blocks: list[nn.Module], model: nn.Module) -> str:
    """'4 x Block + root' for the log line."""
    if not blocks:
        return f"root only ({type(model).__name__})"
    kinds = Counter(type(b).__name__ for b in blocks)
    return ", ".join(f"{n} x {kind}" for kind, n in kinds.items()) + " + root"
