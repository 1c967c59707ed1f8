"""The probes' hook on the timeline: when the measured steps end, the candidate fixes the rules want timed are
replayed on the script's own model (probe.py), an FSDP2 model's communication setting is timed on the job's own steps
(comm_trial.py), and the next step's FLOPs counted."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from trainfast.diagnose.capture.comm_trial import BASE, CANDIDATE, TRIAL_ID, WARM, CommTrial, resharding
from trainfast.diagnose.capture.instrument import Instrumentation
from trainfast.diagnose.capture.probe import BUDGET_SHARE, MAX_PROBE_S, candidates, run_trials, unwrap
from trainfast.diagnose.capture.resolve import device_of
from trainfast.diagnose.capture.timeline import Timeline
from trainfast.diagnose.capture.window import MEASURE
from trainfast.diagnose.records.trials import TrialRequest, Trials
from trainfast.flops import FlopCounter
from trainfast.trainer.settings import torch_settings

# One step after the measured ones, its FLOPs counted (FlopCounterMode slows it: it is not among the measured)
FLOPS_PHASE = "flops"


# Steps counted at the most, when the one counted spans an evaluation pass (the HF Trainer's every N steps)
MAX_FLOPS_TRIES = 3


def gain_probe(timeline: Timeline, instrumentation: Instrumentation,
               wanted: Callable[[], Iterable[TrialRequest]] = tuple) -> Callable[[str], None]:
    """A `Timeline.on_phase_end`: when the measured steps end, time the candidate fixes (`wanted`: what the fixes
    ask for, from the evidence so far) on the script's own model
    and first training input (probe.py), within `BUDGET_SHARE` of the budget left (the timeline's deadline) and
    `MAX_PROBE_S` (the time is the doctor's, not the script's: `Timeline.pause`); then count the FLOPs of the next
    step, whole, as the script runs it. Not for a compiled model: it would recompile under the counting mode. Every
    rank of a job decides alike (on whether the model is compiled and sharded, not on a timing), so all take the same
    steps."""
    comm: list[CommTrial] = []  # the FSDP2 trial under way

    def on_phase_end(phase: str) -> None:
        observed = instrumentation.observed
        if phase in (WARM, BASE, CANDIDATE) and comm:
            if comm[0].on_phase_end(phase):
                assert observed.trials is not None
                observed.trials.trials[TRIAL_ID] = comm.pop().trial()
                _count_flops()
            return
        if phase == FLOPS_PHASE and observed.flop_counter is not None:
            flops, counted = observed.flop_counter.stop(), timeline.phases[-1]
            observed.flop_counter = None
            # the count runs from one step's close to the next's, at the next input: an evaluation pass after the
            # update (the HF Trainer's every N steps) falls in it, and is not the training step's
            if not counted.left_out and not timeline.evaluating_now:
                observed.flops_per_step = flops
            elif sum(p.name == FLOPS_PHASE for p in timeline.phases) < MAX_FLOPS_TRIES:
                _count_next_step()  # that count held an evaluation pass's forwards too
            else:
                observed.flops_reason = (f"each of {MAX_FLOPS_TRIES} steps counted spanned an evaluation pass, "
                                         "whose forwards are not the training step's")
            return
        if phase != MEASURE or instrumentation.observed.trials is not None:
            return
        _time_candidates()
        modules = resharding(unwrap(module) for module, _ in instrumentation.last_calls.values())
        if modules and torch.distributed.is_available() and torch.distributed.is_initialized():
            comm.append(CommTrial(timeline, modules, _device()))
            assert observed.trials is not None
            observed.trials.trials[TRIAL_ID] = comm[0].unfinished()
            return
        _count_flops()

    def _count_flops() -> None:
        if instrumentation.observed.compiled_model or instrumentation.observed.dynamo_at_end.get("frames", 0) > \
                instrumentation.observed.dynamo_at_start.get("frames", 0):
            instrumentation.observed.flops_reason = "the model is compiled: counting would make torch.compile recompile"
            return
        _count_next_step()

    def _count_next_step() -> None:
        timeline.add_phase(FLOPS_PHASE, warmup=0, steps=1)
        instrumentation.observed.flop_counter = FlopCounter().start()

    def _device() -> torch.device:
        observed = instrumentation.observed
        index = observed.device_index
        return torch.device(device_of(observed)) if index is None else torch.device(device_of(observed), index)

    def _time_candidates() -> None:
        calls = list(instrumentation.last_calls.values())
        if not calls:
            instrumentation.observed.trials = Trials(reason="no training forward of a model was seen")
            return
        started = time.perf_counter()
        left = MAX_PROBE_S if timeline.deadline is None else max(0.0, timeline.deadline - started)
        observed = instrumentation.observed
        models = len({id(unwrap(module)) for module, _ in calls})
        # forward + backward passes per step, of each model: gradient accumulation replays the model more than once
        replays = max(1.0, timeline.backwards / timeline.optimizer_steps / models) if timeline.optimizer_steps else 1.0
        device = _device()
        tried, skipped = candidates(wanted(), device=device, autocast=tuple(sorted(observed.autocast)),
                                    threads=torch.get_num_threads())  # (the script's thread count, now)
        instrumentation.paused = True
        try:
            with torch_settings():  # (a candidate's thread count is put back)
                trials = run_trials(calls, tried, base_autocast=tuple(observed.autocast),
                                    budget_s=min(MAX_PROBE_S, BUDGET_SHARE * left), replays=replays)
        finally:
            instrumentation.paused = False
            instrumentation.doctor_time(time.perf_counter() - started, "probe")
        trials.trials = skipped | trials.trials
        instrumentation.observed.trials = trials
    return on_phase_end
