"""The steps' hook: the signals that end a training step (timeline.py says what defines one): torch's global
optimizer step hooks, `torch.autograd.backward` (with DDP's exposed all-reduce timed around it: comms.py), and
`GradScaler.step`, which counts as an optimizer step when it skips one and sums the steps it skipped on the device
(read at report time: reading it synchronises). A counter and a call per step; the first ones also look for the
model (model_hook.py) and describe what each optimizer trains. Each backward's scalar is kept, unread, as the
script's loss (losses.py; `GradScaler.scale` is watched for the loss before its scale)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from trainfast.diagnose.capture.losses import Losses

if TYPE_CHECKING:
    from trainfast.diagnose.capture.model_hook import ModelHook
    from trainfast.diagnose.capture.observations import Patch, Watching


class StepHook:
    def __init__(self, inst: Watching, model: ModelHook) -> None:
        self.inst, self.model = inst, model
        self.optimizer_stepped = 0  # optimizer steps seen by the hook (a GradScaler's skipped step is not one)
        self.losses = Losses(inst.timeline, whole_run=inst.ledger is not None)
        self._handles: list[Callable[[], None]] = []

    def install(self, patch: Patch) -> None:
        inst, model, timeline = self.inst, self.model, self.inst.timeline

        def step_begins(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            timeline._in_optimizer = True  # (timeline.optimizer_step_begins, inlined: ~0.3 us a step)

        def on_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if inst.paused:
                return
            self.optimizer_stepped += 1
            if id(optimizer) not in model._described:
                model.describe_model(optimizer)
            if inst.scanning:
                inst.discover("optimizer step")
            timeline.optimizer_step(optimizer)
            if inst.events is not None:
                inst.events.work_done()

        self._handles = [register_optimizer_step_post_hook(on_step).remove,
                         register_optimizer_step_pre_hook(step_begins).remove]
        backward = torch.autograd.backward
        collectives = inst.collectives
        losses = self.losses

        def counted_backward(*args: Any, **kwargs: Any) -> Any:
            ddp = collectives.ddp_backward(args, kwargs) if collectives.installed else None
            out = backward(*args, **kwargs)
            if ddp is not None:
                ddp()
            if inst.paused:
                return out
            if inst.scanning:
                inst.discover("backward")
            losses.backward(args, kwargs, in_closure=timeline._in_optimizer)
            timeline.backward()
            if inst.events is not None:
                inst.events.work_done()
            return out
        patch(torch.autograd, "backward", counted_backward)
        self._scaler(patch)

    def _scaler(self, patch: Patch) -> None:
        inst, observed = self.inst, self.inst.observed
        scaler_cls = torch.amp.GradScaler
        scaler_step = scaler_cls.step

        def step(scaler: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            stepped = self.optimizer_stepped
            out = scaler_step(scaler, optimizer, *args, **kwargs)
            if self.optimizer_stepped == stepped:  # inf/NaN gradients: the scaler skipped the step, still a step
                inst.timeline.optimizer_step(optimizer)
                inst.work_done()
            if scaler.is_enabled():
                observed.scaler_steps += 1
                state = scaler._per_optimizer_states.get(id(optimizer), {})
                for found in state.get("found_inf_per_device", {}).values():  # summed on the device, no sync
                    key = str(found.device)
                    total = observed.scaler_found_inf.get(key)
                    observed.scaler_found_inf[key] = found.detach().float() if total is None else total + found
            return out
        patch(scaler_cls, "step", step)
        scaler_scale = scaler_cls.scale
        losses = self.losses

        def scale(scaler: Any, outputs: Any) -> Any:
            out = scaler_scale(scaler, outputs)
            if isinstance(outputs, torch.Tensor) and out is not outputs and not inst.paused:
                losses.scaled(out, outputs)
            return out
        patch(scaler_cls, "scale", scale)

    def uninstall(self) -> None:
        while self._handles:
            self._handles.pop()()
