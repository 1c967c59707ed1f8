"""`Capture`: everything the doctor measured and observed in one run, frozen when the run ends, and everything the
report is made from. The stages after capture read only this: the evidence, the verdict, the fixes and the report are
pure functions of it, so a capture saved as JSON (`to_json`, `from_json`: exact, floats included) gives the same
report on any machine, which is how the recorded runs under tests/unit/diagnose/golden/ hold the doctor's behaviour.

What the machine said at the end of the run is read then and kept here too (its usable CPUs, whether bf16 is native,
cudnn.benchmark as the script had it, the matmul peak MFU is measured against, the host's name), as are the figures
that synchronise the device (the GradScaler's skipped steps, the peak memory, the CUDA events' step times): a capture
taken mid-run (`final` False, for the rules that choose which trials to time) leaves those out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from trainfast.diagnose.records.ledger import EvalPass, Write
from trainfast.diagnose.records.steps import LoaderStats, StepRecord, WorkerTotals
from trainfast.diagnose.records.trials import Trial, Trials
from trainfast.flops import Peak
from trainfast.monitor.series import Series

JSON = dict[str, Any]


@dataclass(frozen=True)
class Site:
    """Where in the script an object a fix changes was made or used (capture/sites.py): the first frame outside torch,
    trainfast and installed packages; `framework` the framework whose code made it on the script's behalf (met on the
    way), or called the script's code that did (a Lightning hook): its own setting decides it then. `what`:
    "loader" (a DataLoader's construction, `index` its loader's), "model" (the trained model's construction), "to"
    (its last `.to()`/`.cuda()`), "forward" (its first training call), "evaluation" (its first call with gradients
    off), "autocast" (the script's first autocast block), "save" (its first checkpoint write)."""

    what: str
    file: str | None
    line: int | None
    code: str = ""
    framework: str | None = None
    index: int | None = None


@dataclass(frozen=True)
class TimelineRecord:
    """The measured steps and what the timeline counted (timeline.py)."""

    records: tuple[StepRecord, ...]
    warmup_steps: int
    signal: str | None  # what defined a step: "optimizer", "backward" or "explicit"
    input_source: str | None  # "loader", "script" or None
    loader_fed: bool
    evaluation_steps: int  # measured-range steps left out: they spanned an evaluation pass
    cycle: str | None  # "whole"/"partial": the loop collects between updates
    counts: Mapping[str, int]  # batches, forwards, backwards, optimizer steps seen over the run
    samples_per_s: float | None
    epoch_starts: tuple[int, ...]  # measured steps in which a training loader's new epoch began
    measure_started_monotonic: float | None
    measure_ended_monotonic: float | None
    step_marks: tuple[tuple[int, str], ...] = ()  # (measured step, what else it did: steps.py MARKS)
    left_out: tuple[int, ...] = ()  # a step spanning an evaluation left out before each of these records

    def seen(self) -> dict[str, int]:
        return dict(self.counts)


@dataclass(frozen=True)
class ObservedRecord:
    """What the hooks saw the script use, resolved when the run ended (instrument.py's `Observations`)."""

    device: str  # the model's device type ("cuda" without a model seen when the process did CUDA work)
    device_index: int | None
    threads_seen: int  # intra-op threads when training started (0: no optimizer step seen)
    threads: int  # the same, or the count at the end when none was seen
    parameters: int
    parameter_dtypes: tuple[str, ...]
    autocast: tuple[tuple[str, str], ...]  # (device, dtype) entered, sorted
    compiled: bool
    recompiled_frames: int
    graph_breaks: int
    conv_weights: int
    conv_weights_channels_last: int
    conv_weights_ambiguous: int
    input_layout: str | None
    scaler_steps: int
    scaler_skipped_steps: int  # 0 in a mid-run capture (reading it synchronises)
    jpeg_decoded_pixels: float | None  # median
    trials: Trials | None  # the candidate fixes timed on the model
    flops_per_step: int | None
    flops_reason: str | None
    peak: Peak | None  # the peak MFU is measured against, where FLOPs were counted
    peak_error: str | None  # why there is none for the run's precision on its device
    collectives: JSON | None  # comms.py `collectives_json`
    worker_window: WorkerTotals | None  # the workers' own account over the measured window
    device_step_s: tuple[float, ...] | None  # each measured step's device time (CUDA events); None without
    gpu_memory_fraction: float | None  # peak allocated / total on the model's GPU (final captures)


@dataclass(frozen=True)
class MachineRecord:
    cpus: int  # usable by this process (affinity, cgroup quota)
    logical_cpus: int  # the machine's, where the monitor sampled no per-CPU figure
    bf16_native: bool  # on the model's device
    cudnn_benchmark: bool  # as the script had it
    host: str


@dataclass(frozen=True)
class LedgerRecord:
    """A whole run's `Ledger` (ledger.py), as `wholerun.account` reads it."""

    process_start: float
    intervals: tuple[tuple[str, float, float], ...]
    writes: tuple[Write, ...]
    write_totals: Mapping[str, float]
    passes: tuple[EvalPass, ...]
    epoch_starts: tuple[tuple[float, float, float], ...]
    step_start: tuple[float, ...]
    step_end: tuple[float, ...]
    step_wait: tuple[float, ...]
    step_transfer: tuple[float, ...]
    step_gap: tuple[float, ...]
    step_samples: tuple[int, ...]
    first_input: float | None
    loader_fed: bool
    doctor_parts: Mapping[str, float]


@dataclass(frozen=True)
class WholeRecord:
    """`doctor --whole-run`: the ledger, where the script ended, and what the whole run's fixes had timed."""

    ledger: LedgerRecord
    end: float  # perf_counter time the script ended
    compiled: bool  # torch.compile compiled frames in this run
    warmup: int
    trial: Trial | None  # evaluation under autocast + inference_mode against the script's (capture/whole_trials.py)
    bandwidth: float | None  # bytes/s of a copy to host memory
    lost_progress: JSON | None  # capture/attempts.py, after torchrun restarted the job


@dataclass(frozen=True)
class Capture:
    timeline: TimelineRecord
    observed: ObservedRecord
    loaders: tuple[LoaderStats, ...]
    machine: MachineRecord
    monitor: Series | None = None
    env: JSON | None = None
    script: JSON | None = None
    notes: tuple[str, ...] = ()
    oom: JSON | None = None
    loader_headroom: float | None = None  # the loader replayed alone over training (diagnose())
    whole: WholeRecord | None = None
    final: bool = True
    sites: tuple[Site, ...] = ()

    def to_json(self) -> JSON:
        encoded: JSON = _encode(self)
        return encoded

    @classmethod
    def from_json(cls, data: JSON) -> Capture:
        t, o, m, w = data["timeline"], data["observed"], data["machine"], data["whole"]
        return cls(
            timeline=TimelineRecord(**(t | {"records": tuple(StepRecord(**r) for r in t["records"]),
                                            "epoch_starts": tuple(t["epoch_starts"]),
                                            "step_marks": tuple(tuple(m) for m in t.get("step_marks", ())),
                                            "left_out": tuple(t.get("left_out", ()))})),
            observed=ObservedRecord(**(o | {
                "parameter_dtypes": tuple(o["parameter_dtypes"]), "autocast": tuple(map(tuple, o["autocast"])),
                "trials": _trials(o["trials"]), "peak": Peak(**o["peak"]) if o["peak"] else None,
                "worker_window": WorkerTotals(*o["worker_window"]) if o["worker_window"] else None,
                "device_step_s": tuple(o["device_step_s"]) if o["device_step_s"] is not None else None})),
            loaders=tuple(_loader(s) for s in data["loaders"]),
            machine=MachineRecord(**m),
            monitor=Series.from_json(data["monitor"]) if data["monitor"] is not None else None,
            env=data["env"], script=data["script"], notes=tuple(data["notes"]), oom=data["oom"],
            loader_headroom=data["loader_headroom"], whole=_whole(w) if w is not None else None,
            final=data["final"], sites=tuple(Site(**site) for site in data.get("sites", ())))


def _encode(value: Any) -> Any:
    """A record as JSON: dataclasses field by field (a Trial's `value` included), tuples as lists."""
    if isinstance(value, Series):
        return value.to_json()
    if hasattr(value, "__dataclass_fields__"):
        return {name: _encode(getattr(value, name)) for name in value.__dataclass_fields__}
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _trial(data: JSON) -> Trial:
    value = data["value"]
    return Trial(**(data | {"value": tuple(value) if isinstance(value, list) else value}))


def _trials(data: JSON | None) -> Trials | None:
    if data is None:
        return None
    return Trials(**(data | {"trials": {key: _trial(t) for key, t in data["trials"].items()}}))


def _loader(data: JSON) -> LoaderStats:
    hw = data["image_hw"]
    return LoaderStats(**(data | {"startup_s": list(data["startup_s"]), "image_hw": tuple(hw) if hw else None}))


def _whole(data: JSON) -> WholeRecord:
    ledger = data["ledger"]
    arrays = ("step_start", "step_end", "step_wait", "step_transfer", "step_gap", "step_samples")
    record = LedgerRecord(**(ledger | {name: tuple(ledger[name]) for name in arrays} | {
        "intervals": tuple(tuple(i) for i in ledger["intervals"]),
        "writes": tuple(Write(**w) for w in ledger["writes"]), "passes": tuple(EvalPass(**p) for p in ledger["passes"]),
        "epoch_starts": tuple(tuple(e) for e in ledger["epoch_starts"])}))
    return WholeRecord(**(data | {"ledger": record, "trial": _trial(data["trial"]) if data["trial"] else None}))


def loaders_of(stats: Sequence[LoaderStats]) -> tuple[LoaderStats, ...]:
    """Copies of the hooks' loader figures, which go on changing while the script runs."""
    return tuple(replace(s, startup_s=list(s.startup_s), dataset_set_after_start=list(s.dataset_set_after_start))
                 for s in stats)
