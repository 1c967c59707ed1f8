"""The script's own loss, as the steps' hook sees it (step_hook.py): the scalar each `backward` is given, kept per
step without reading it (`detach()`: no host sync; a `.item()` a step would wait for the device every step) and read
once when the run ends (`read`, into records/losses.py's `LossTrace`). Under a `GradScaler`, the loss before
`scaler.scale(loss)`: the scale halves and doubles, the loss does not.

Which steps: a window run keeps every step from the first (a run with more loader workers warms up longer, and its
losses are compared with the baselines' at the same steps), up to `KEEP` of them; a whole run, its last `steps`: what
it ends with. Where no scalar is seen, `unseen` says why: a backward on a non-scalar tensor or several at once, or
only inside `optimizer.step(closure)` (LBFGS evaluates its closure several times a step)."""

from __future__ import annotations

import collections
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from trainfast.diagnose.capture.timeline import Timeline
from trainfast.diagnose.records.losses import LossTrace

# Steps kept in a window run: its warm-up (which more workers lengthen to the batches they hold in flight) and its
# measured steps; 10,000 scalars are ~5 MB of a GPU's smallest blocks at most.
KEEP = 10_000


class Losses:
    """Each step's backward scalars (detached), by the script's step index (`Timeline.closed_steps` when it ran)."""

    def __init__(self, timeline: Timeline, *, whole_run: bool) -> None:
        self.timeline, self.whole_run = timeline, whole_run
        keep = max(1, timeline.max_steps or 1) if whole_run else KEEP
        self._steps: collections.deque[tuple[int, list[torch.Tensor]]] = collections.deque(maxlen=keep)
        self._measured: list[int] = []  # the first and the last step index seen while measuring
        self._unseen: str | None = None
        self._scaled: tuple[weakref.ref[torch.Tensor], torch.Tensor] | None = None  # scaler.scale's (out, loss)

    def scaled(self, out: torch.Tensor, loss: torch.Tensor) -> None:
        """`scaler.scale(loss)` returned `out`: a backward on `out` is one on `loss`."""
        self._scaled = (weakref.ref(out), loss.detach())

    def backward(self, args: Sequence[Any], kwargs: dict[str, Any], *, in_closure: bool) -> None:
        """A backward the script ran (not the doctor's own): keep its scalar for the step in progress."""
        tensors = kwargs["tensors"] if "tensors" in kwargs else (args[0] if args else None)
        if isinstance(tensors, (list, tuple)):
            tensors = tensors[0] if len(tensors) == 1 else tensors
        if in_closure:
            self._unseen = self._unseen or "the backward runs inside optimizer.step(closure), once or more a step"
            return
        if not isinstance(tensors, torch.Tensor):
            self._unseen = self._unseen or f"a backward on {len(tensors or ())} tensors at once, not one loss"
            return
        if tensors.numel() != 1:
            self._unseen = self._unseen or (f"a backward on a tensor of shape {tuple(tensors.shape)}, not a scalar "
                                            "loss")
            return
        loss = tensors
        scaled = self._scaled
        if scaled is not None and scaled[0]() is loss:
            loss, self._scaled = scaled[1], None
        index = self.timeline.closed_steps
        if not self.whole_run and self.timeline.measuring:
            if self._measured:
                self._measured[1:] = [index]
            else:
                self._measured = [index, index]
        steps = self._steps
        if steps and steps[-1][0] == index:
            steps[-1][1].append(loss.detach())
        else:
            steps.append((index, [loss.detach()]))

    def read(self) -> LossTrace:
        """The losses as floats (each read once, now: after the run, where a sync costs the script nothing)."""
        if not self._steps:
            return LossTrace(None, (), None, self._unseen or "no backward was seen (no loss.backward() call)")
        first, last = self._steps[0][0], self._steps[-1][0]
        values: list[float | None] = [None] * (last - first + 1)
        for index, losses in self._steps:
            values[index - first] = sum(float(t.float().reshape(())) for t in losses) / len(losses)
        steps = (first, last) if self.whole_run else (self._measured[0], self._measured[-1]) if self._measured \
            else None
        return LossTrace(first, tuple(values), steps, None)
