"""FSDP2's communication fix timed in the job itself, on every rank alike.

An FSDP2 block (`fully_shard`) that reshards its parameters after forward (the default) all-gathers them again in
backward. Keeping them gathered (`reshard_after_forward=False`) removes those all-gathers, for the memory of the
gathered parameters. No replay can time it: a copy of the model needs the job's other ranks in its collectives. So the
job's own steps are: when the measured steps end, every rank runs `ROUNDS` rounds of `STEPS` steps as the script has
them ("base"), then `STEPS` with the parameters kept gathered ("candidate"), each after `WARMUP` steps, and the
setting is put back after each round.

Every rank decides alike, so that no rank waits on another in a collective it does not issue: whether to run is
decided on the model's structure (an FSDP2 module that reshards after forward), never on a timing, and the setting
switches at a phase's end, which every rank reaches at the same closed step (phases are counted in steps). A phase's
time runs from the previous phase's end to its own (a step closes at the next one's first input; on CUDA once the
device's queued work is done, so that the host running ahead does not hide it), over its steps; the factor is the
median over the rounds of base / candidate, with the spread. The whole step is timed: the step's gain as measured,
nothing assumed.
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

ROUNDS, STEPS, WARMUP = 4, 2, 1  # 24 steps: a 60-step script still finishes them after the 35 measured
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
        for _ in range(ROUNDS):
            for name, steps in ((WARM, WARMUP), (BASE, STEPS), (WARM, WARMUP), (CANDIDATE, STEPS)):
                timeline.add_phase(name, warmup=0, steps=steps)
        self._first = len(timeline.phases) - 4 * ROUNDS
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
        return len(self._ends) == 4 * ROUNDS

    def restore(self) -> None:
        for state, meshes in self._saved:
            with contextlib.suppress(Exception):
                for group, mesh in zip(state._fsdp_param_groups, meshes, strict=True):
                    group.post_forward_mesh_info = mesh

    def unfinished(self) -> Trial:
        """What the report says where the run ends inside the trial (replaced by `trial()` at its end)."""
        return Trial(TRIAL_ID, SETTING, reason=f"the run ended inside the trial's {ROUNDS} rounds "
                                              f"({ROUNDS * 2 * (WARMUP + STEPS)} steps)")

    def trial(self) -> Trial:
        """The measured trial: each round's base / candidate seconds a step, from the phases' ends."""
        phases = self.timeline.phases[self._first:]
        ratios, bases = [], []
        for r in range(ROUNDS):
            i = 4 * r
            base_s = (self._ends[i + 1] - self._ends[i]) / max(1, phases[i + 1].seen)
            candidate_s = (self._ends[i + 3] - self._ends[i + 2]) / max(1, phases[i + 3].seen)
            ratios.append(base_s / candidate_s if candidate_s > 0 else 1.0)
            bases.append(base_s)
        return Trial.of_rounds(TRIAL_ID, SETTING, ratios, bases, value=False)
