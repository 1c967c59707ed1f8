"""FSDP2's communication fix timed in the job itself, on every rank alike.

An FSDP2 block (`fully_shard`) that reshards its parameters after forward (the default) all-gathers them again in
backward. Keeping them gathered (`reshard_after_forward=False`) removes those all-gathers, for the memory of the
gathered parameters. No replay can time it: a copy of the model needs the job's other ranks in its collectives. So the
job's own steps are: when the measured steps end, every rank runs `ROUNDS` rounds of `STEPS` steps as the script has
them ("base"), then `STEPS` with the parameters kept gathered ("candidate"), each after `WARMUP` steps, and the
setting is put back after the last round.

Every rank decides alike, so that no rank waits on another in a collective it does not issue: whether to run is
decided on the model's structure (an FSDP2 module that reshards after forward), never on a timing, and the setting
switches at a phase's end, which every rank reaches at the same closed step (phases are counted in steps). The factor
is the median over the rounds of base / candidate step time (each phase's median step), with the spread; the whole
step is timed, so it is the step's gain as measured, nothing assumed.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterable
from typing import Any

from torch import nn

from trainfast.diagnose.capture.timeline import Timeline
from trainfast.diagnose.records.trials import Trial

ROUNDS, STEPS, WARMUP = 4, 2, 1  # 24 steps: a 60-step script still finishes them after the 35 measured
BASE, CANDIDATE = "comm-base", "comm-candidate"
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

    def __init__(self, timeline: Timeline, modules: list[Any]) -> None:
        self.timeline, self.modules = timeline, modules
        # each module's own setting, put back exactly (its groups' post-forward mesh, and FSDP's auto flag)
        self._saved = [(m._get_fsdp_state(), [g.post_forward_mesh_info for g in _groups(m)]) for m in modules]
        for _ in range(ROUNDS):
            timeline.add_phase(BASE, warmup=WARMUP, steps=STEPS)
            timeline.add_phase(CANDIDATE, warmup=WARMUP, steps=STEPS)
        self._first = len(timeline.phases) - 2 * ROUNDS

    def on_phase_end(self, phase: str) -> bool:
        """Switch the setting at a trial phase's end; True when the trial's last phase ended."""
        if phase == BASE:
            for module in self.modules:
                module.set_reshard_after_forward(False, recurse=False)
        elif phase == CANDIDATE:
            self.restore()
        return phase == CANDIDATE and all(p.done for p in self.timeline.phases[self._first:])

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
        """The measured trial, or why it is not (the run ended inside it)."""
        phases = self.timeline.phases[self._first:]
        pairs = [(phases[i], phases[i + 1]) for i in range(0, len(phases), 2)]
        ratios, bases = [], []
        for base, candidate in pairs:
            if not (base.done and candidate.done and base.rows and candidate.rows):
                break
            base_s = statistics.median(row[1] for row in base.rows)
            candidate_s = statistics.median(row[1] for row in candidate.rows)
            if candidate_s > 0:
                ratios.append(base_s / candidate_s)
                bases.append(base_s)
        if len(ratios) < ROUNDS:
            self.restore()
            return Trial(TRIAL_ID, SETTING, rounds=len(ratios),
                         reason=f"the run ended after {len(ratios)} of the trial's {ROUNDS} rounds "
                                f"({ROUNDS * 2 * (WARMUP + STEPS)} steps)")
        return Trial.of_rounds(TRIAL_ID, SETTING, ratios, bases, value=False)
