"""What the training loop does differently when it is one of several ranks: DDP's wrapper or FSDP's sharding
(`sharding.py`), no gradient reduction inside a gradient-accumulation cycle, and stops agreed by every rank at the
same step."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainfast.precision.policy import PrecisionPolicy
from trainfast.trainer.distributed import dist_initialized
from trainfast.trainer.sharding import shard
from trainfast.trainer.signals import StopSchedule, StopSignal

_NOTHING = nullcontext()  # reusable: no object built per step


class Ranks:
    def __init__(self) -> None:
        self.ddp: DistributedDataParallel | None = None
        self.fsdp: nn.Module | None = None  # the model, sharded in place by FSDP
        self.alone = True  # no other rank to agree with
        self.stops = StopSchedule()
        self.described = ""  # what was sharded, for the strategy's log line
        self._syncing = True  # FSDP reduce-scatters gradients in this backward

    @property
    def sharded(self) -> bool:
        return self.fsdp is not None

    def start(self, model: nn.Module, device: torch.device, strategy: str | None,
              optimizer: torch.optim.Optimizer | None = None, precision: PrecisionPolicy | None = None) -> nn.Module:
        """At the start of a fit: the model to train under `strategy` ("ddp", "fsdp", None alone): DDP-wrapped, or
        sharded in place with `optimizer` pointed at the shards (compile comes after, in Practices: compiling the DDP
        module lets dynamo split graphs at buckets). ValueError for what FSDP cannot train (fp16, a stepped
        optimizer)."""
        from torch.distributed.fsdp import FSDPModule
        self.stops = StopSchedule()
        if strategy == "fsdp":
            if isinstance(model, FSDPModule):  # its shards live on the first fit's process group, destroyed since
                raise ValueError("a Trainer whose model FSDP sharded trains in one fit only; make a new Trainer for "
                                 "the next one (fit(resume=True) continues from the checkpoint)")
            assert optimizer is not None and precision is not None
            self.described = f"; fully_shard on {shard(model, optimizer, precision)}"
            self.fsdp = model
        elif strategy == "ddp":
            ids = [device.index] if device.type == "cuda" else None
            self.ddp = DistributedDataParallel(model, device_ids=ids)
        self.alone = self.ddp is None and self.fsdp is None and not dist_initialized()  # read once: ~1 us a step
        return self.ddp if self.ddp is not None else model

    def sync_grads(self, boundary: bool) -> AbstractContextManager[object]:
        """Inside a gradient-accumulation cycle DDP need not all-reduce, nor FSDP reduce-scatter: only the cycle's
        last backward does."""
        if self.fsdp is not None:
            if boundary != self._syncing:  # set only on a change: it visits every sharded module
                self.fsdp.set_requires_gradient_sync(boundary)  # type: ignore[operator]
                self._syncing = boundary
            return _NOTHING
        return self.ddp.no_sync() if self.ddp is not None and not boundary else _NOTHING

    def stop_agreed(self, stop: StopSignal, step: int, at_log_point: bool, device: torch.device,
                    writes: int = 1) -> bool:
        """Stop now? Alone: whenever a signal came. Distributed: every rank at the same step, so the ranks agree
        every few seconds and at log points (a collective then, no per-step sync); a scheduler may signal only
        some ranks."""
        if self.alone:
            return stop.requested is not None
        self.stops.writes = 1
        return (at_log_point or self.stops.due(step)) and self.stops.agree(stop.requested is not None, step, device,
                                                                          writes)

    def writes_settled(self) -> int | None:
        """At this step's stop agreement: every rank's part of the checkpoint in flight written (0), or some rank's
        failed (2); None otherwise (no agreement this step, or a part still being written)."""
        return None if self.stops.writes == 1 else self.stops.writes
