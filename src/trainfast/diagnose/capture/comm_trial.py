"""FSDP2's communication fix timed in the job itself, on every rank alike.

An FSDP2 block (`fully_shard`) that reshards its parameters after forward (the default) all-gathers them again in
backward. Keeping them gathered (`reshard_after_forward=False`) removes those all-gathers, for the memory of the
gathered parameters. No replay can time it: a copy of the model needs the job's other ranks in its collectives. So the
job's own steps are: when the measured steps end, every rank runs one step as the script has it, then `ROUNDS` pairs
of steps: one as the script has it ("base"), the next with the parameters kept gathered ("candidate"), the setting put
back after it. A step needs no warm-up after the switch: FSDP reshards every block after backward whatever the
setting, so no step leaves anything to the next.

Every rank decides alike, so that no rank waits on another in a collective it does not issue: whether to run is
decided on the model's structure (an FSDP2 module that reshards after forward), never on a timing, and the setting
switches at a phase's end, which every rank reaches at the same closed step (phases are counted in steps). A phase's
time runs from the previous phase's end to its own (a step closes at the next one's first input; on CUDA once the
device's queued work is done, so that the host running ahead does not hide it), over its steps; the pairs are
decided by the one decision (`trainfast.decide`: the median of base / candidate, an interval from the pairs'
spread, which here is tens of percent a step): a gain is claimed only when decided faster. The whole step is timed:
the step's gain as measured, nothing assumed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from trainfast.diagnose.capture.timeline import Timeline
from trainfast.diagnose.records.trials import Trial

# 12 pairs of adjacent steps (25 steps with the first): a 60-step script still finishes them after the 35 measured.
# Adjacent single steps, not runs of a few: on a shared 2-core machine runs of 2 steps after a warm-up each gave
# 0.95x to 1.57x on the same job, the machine's load drifting between the runs.
ROUNDS = 12
WARM, BASE, CANDIDATE = "comm-warm", "comm-base", "comm-candidate"
TRIAL_ID = "fsdp_reshard"
SETTING = "parameters kept gathered from forward to backward (reshard_after_forward=False)"


def resharding(models: Iterable[nn.Module]) -> list[Any]:
    """The FSDP2 modules of `models` that reshard their parameters after forward: the ones the candidate changes."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    found: list[Any] = []
    seen: set[int] = set()
    for model in models:
        for module in model.modules():
            if isinstance(module, FSDPModule) and id(module) not in seen:
                seen.add(id(module))
                if any(group.post_forward_mesh_info is not None for group in _groups(module)):
                    found.append(module)
    return found


def _groups(module: Any) -> list[Any]:
    """An FSDP2 module's parameter groups (torch's private state: none where it has changed)."""
    with contextlib.suppress(Exception):
        return list(module._get_fsdp_state()._fsdp_param_groups)
    return []


class CommTrial:
    """The alternating phases on the timeline and the setting they switch (module doc)."""

    def __init__(self, timeline: Timeline, modules: list[Any], device: torch.device | None = None) -> None:
        self.timeline, self.modules, self.device = timeline, modules, device
        # each module's own setting, put back exactly (its groups' post-forward mesh)
        self._saved = [(m._get_fsdp_state(), [g.post_forward_mesh_info for g in _groups(m)]) for m in modules]
        timeline.add_phase(WARM, warmup=0, steps=1)  # its end: the first pair's start, on a step boundary
        for _ in range(ROUNDS):
            timeline.add_phase(BASE, warmup=0, steps=1)
            timeline.add_phase(CANDIDATE, warmup=0, steps=1)
        self._first = len(timeline.phases) - 2 * ROUNDS - 1
        self._ends: list[float] = []  # each trial phase's end, the device's work done

    def on_phase_end(self, phase: str) -> bool:
        """At a trial phase's end: note the time (after the device's queued work), then switch the setting for the
        next phase; True when the trial's last phase ended."""
        if self.device is not None and self.device.type == "cuda":  # a phase's time is its device work's, not the
            torch.cuda.synchronize(self.device)  # host's running ahead of it
        self._ends.append(time.perf_counter())
        if phase == BASE:
            for module in self.modules:
                module.set_reshard_after_forward(False, recurse=False)
        elif phase == CANDIDATE:
            self.restore()
        return len(self._ends) == 2 * ROUNDS + 1

    def restore(self) -> None:
        for state, meshes in self._saved:
            with contextlib.suppress(Exception):
                for group, mesh in zip(state._fsdp_param_groups, meshes, strict=True):
                    group.post_forward_mesh_info = mesh

    def unfinished(self) -> Trial:
        """What the report says where the run ends inside the trial (replaced by `trial()` at its end)."""
        return Trial(TRIAL_ID, SETTING, reason=f"the run ended inside the trial's {2 * ROUNDS + 1} steps")

    def trial(self) -> Trial:
        """The measured trial: each pair's base / candidate seconds a step, from the phases' ends."""
        phases, ends = self.timeline.phases[self._first:], self._ends
        ratios, bases = [], []
        for r in range(ROUNDS):
            i = 1 + 2 * r
            base_s = (ends[i] - ends[i - 1]) / max(1, phases[i].seen)
            candidate_s = (ends[i + 1] - ends[i]) / max(1, phases[i + 1].seen)
            ratios.append(base_s / candidate_s if candidate_s > 0 else 1.0)
            bases.append(base_s)
        return Trial.of_rounds(TRIAL_ID, SETTING, ratios, bases, value=False)
