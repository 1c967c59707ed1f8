"""The doctor as a library: `diagnose(loader, step_fn)` measures a loader and a step the caller gives, `Doctor`
measures an existing loop (`with Doctor() as doctor: <train>`). Both are wired as `run_doctor` is (run/doctor.py):
the hooks, the probe, the capture, the report."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from contextlib import nullcontext
from typing import Any

from torch import nn

from trainfast.diagnose.capture.instrument import Instrumentation
from trainfast.diagnose.capture.timeline import Timeline
from trainfast.diagnose.records.findings import Note
from trainfast.diagnose.report.report import Report
from trainfast.diagnose.run.doctor import build_report, probe_hook
from trainfast.envcheck.environment import environment, loader_settings
from trainfast.loader.prefetch import InputTransform, move
from trainfast.monitor import Monitor
from trainfast.samples import batch_samples
from trainfast.trainer.settings import torch_settings
from trainfast.trainer.step import TrainStep, default_batch_loss, forward_backward


def _forward_backward(model: nn.Module, loader: Any) -> TrainStep:
    """The default step for `diagnose(loader, model=...)`: forward, the Trainer's default loss
    (`trainfast.trainer.step.default_batch_loss`: `(inputs, targets)` pairs and Hugging Face style mappings), backward.
    A pair's inputs get the loader's normalisation (trainfast loaders yield uint8 images) as in the Trainer; a
    mapping is moved to the model's device as it is."""
    device = next(model.parameters()).device
    transform = InputTransform(device, getattr(loader, "normalize", None), channels_last=False)

    def step(batch: Any) -> None:
        batch = move(batch, device) if isinstance(batch, Mapping) else transform(move(batch, device))
        forward_backward(model, batch, default_batch_loss, nullcontext())
        model.zero_grad(set_to_none=True)
    return step


def _loader_rate(loader: Iterable[Any], batches: int, warmup: int) -> float | None:
    """Samples/s of the loader replayed alone (after `warmup` batches), or None if it ran dry.

    A batch's samples are the leading dimension of its first tensor (`trainfast.samples.batch_samples`), dict
    and nested batches alike."""
    seen, samples, started = 0, 0, 0.0
    for batch in loader:
        seen += 1
        if seen == warmup:
            started = time.perf_counter()
        elif seen > warmup:
            samples += batch_samples(batch)
            if seen >= warmup + batches:
                break
    elapsed = time.perf_counter() - started
    return samples / elapsed if seen > warmup and elapsed > 0 else None


def diagnose(loader: Iterable[Any], step_fn: TrainStep | None = None, *, model: nn.Module | None = None,
             steps: int = 30, warmup: int = 5, replay: bool = True) -> Report:
    """Measure `steps` training steps of `step_fn(batch)` fed by `loader` (after `warmup`) and report.

    Without `step_fn`, `model` gets a forward + backward step. With `replay`, the loader is first timed
    alone: how much faster it is than training is the strongest input-bound signal there is. Without a
    step at all, only the loader is measured and there is no verdict.

    The `model=` step's loss is the Trainer's default (`trainfast.trainer.step.default_batch_loss`):
    `(inputs, targets)` batches take cross-entropy against class indices or probabilities, else the mean squared
    error; Mapping batches, Hugging Face style, go to the model's device and in as keyword arguments,
    `model(**batch)`, less `labels` unless `model.forward` has a `labels` parameter, and the loss is the
    output's `loss` when there is one, else the cross-entropy (`ignore_index=-100`) of the logits against integer
    `labels`, else their mean. A batch's samples are the leading dimension of its first tensor, depth first
    (`trainfast.samples.batch_samples`).

    >>> report = trainfast.diagnose(loader, model=model)   # doctest: +SKIP
    >>> report.render()                                    # doctest: +SKIP
    """
    if step_fn is None and model is not None:
        step_fn = _forward_backward(model, loader)
    notes: list[str] = []
    loader_rate = _loader_rate(loader, steps, warmup) if replay and step_fn is not None else None
    timeline = Timeline(warmup_steps=warmup, max_steps=steps, explicit_steps=True)
    with torch_settings(), Monitor() as monitor, Instrumentation(timeline) as inst:
        if step_fn is not None:
            timeline.on_phase_end = probe_hook(timeline, inst)
        while not timeline.done:
            fetched = 0
            for batch in loader:
                fetched += 1
                if step_fn is not None:
                    step_fn(batch)
                inst.end_step()
                if timeline.done:
                    break
            if fetched == 0:
                notes.append("the loader yielded no batch")
                break
    records = timeline.records
    seconds, samples = sum(r.total_s for r in records), sum(r.samples for r in records)
    headroom = loader_rate * seconds / samples if loader_rate and samples and seconds else None
    # Replay headroom says something only for a loader that runs beside training (workers): without workers,
    # loading is part of every step and headroom is just 1 / (1 - data wait).
    asynchronous = (loader_settings(loader)[0] or 0) > 0
    script: dict[str, Any] = {"target": "diagnose()", "loader_samples_per_s": loader_rate, "loader_headroom": headroom}
    report = build_report(timeline, inst, monitor=monitor, env=environment(), notes=notes, script=script,
                          loader_headroom=headroom if asynchronous else None)
    if step_fn is None:
        report.verdict = None
        report.recommendations = []
        report.notes.append(Note("no step_fn or model: only the loader was measured"
                                 + (f" ({report.samples_per_s:,.0f} samples/s)" if report.samples_per_s else ""),
                                 "measurement"))
    return report


class Doctor:
    """Measure an existing loop: `with Doctor() as doctor: <train>`; then `doctor.report`.

    Steps are found as the zero-code doctor finds them (an iteration's optimizer steps, else its backward
    passes; see timeline.py); the first `warmup` are not measured. Nothing is stopped early.
    """

    def __init__(self, *, warmup: int = 5, monitor_interval_s: float = 0.5) -> None:
        self.timeline = Timeline(warmup_steps=warmup)
        self._monitor = Monitor(interval_s=monitor_interval_s)
        self._inst = Instrumentation(self.timeline)
        self.report: Report | None = None

    def __enter__(self) -> Doctor:
        self._monitor.start()
        try:
            self._inst.__enter__()
        except BaseException:
            self._monitor.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._inst.__exit__(*exc)
        self._monitor.stop()
        self.report = build_report(self.timeline, self._inst, monitor=self._monitor, env=environment(),
                                   script={"target": "Doctor()"})
