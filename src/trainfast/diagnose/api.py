"""The doctor as an API: `diagnose(loader, step_fn)` for a loader and a step, `Doctor` around an existing loop."""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable, Mapping
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainfast.diagnose.instrument import Instrumentation
from trainfast.diagnose.report import Report, build_report, gain_probe
from trainfast.diagnose.timeline import Timeline
from trainfast.envcheck.environment import environment, loader_settings
from trainfast.loader.prefetch import InputTransform, move
from trainfast.monitor import Monitor
from trainfast.samples import batch_samples, first_leaf
from trainfast.trainer.settings import torch_settings
from trainfast.trainer.step import TrainStep, forward_backward


def _output_field(out: Any, name: str) -> Any:
    """`out.name` or `out[name]` (Hugging Face outputs have both), or None."""
    return out.get(name) if isinstance(out, Mapping) else getattr(out, name, None)


def _mapping_loss(out: Any, labels: Any) -> torch.Tensor:
    """The loss of a model called on a Mapping batch (the rule in `_forward_backward`)."""
    loss = _output_field(out, "loss")
    if isinstance(loss, torch.Tensor):
        return loss
    logits = out if isinstance(out, torch.Tensor) else _output_field(out, "logits")
    if not isinstance(logits, torch.Tensor):
        logits = first_leaf(out)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"diagnose(loader, model=...) found no loss and no tensor in the model's output "
                        f"({type(out).__name__}); pass diagnose(loader, step_fn) with your own training step")
    if logits.dim() == 0:  # a scalar output is a loss (Hugging Face's tuples put it first)
        return logits
    if isinstance(labels, torch.Tensor) and not labels.is_floating_point() and logits.dim() >= 2:
        return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100)
    return logits.float().mean()


def _takes_labels(model: nn.Module) -> bool:
    """Whether `model.forward` names a `labels` parameter (as Hugging Face models do)."""
    try:
        param = inspect.signature(model.forward).parameters.get("labels")
    except (TypeError, ValueError):  # no signature to read
        return False
    return param is not None and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)


def _forward_backward(model: nn.Module, loader: Any) -> TrainStep:
    """The default step for `diagnose(loader, model=...)`: forward, a loss, backward.

    An `(inputs, targets)` batch: `model(inputs)`, with the loader's normalisation applied to the inputs
    (trainfast loaders yield uint8 images) as in the Trainer; the loss is cross-entropy for a 2-D output and
    class-index targets, otherwise the mean of the output.

    A Mapping batch (Hugging Face style, `{"input_ids": ..., "attention_mask": ..., "labels": ...}`) is moved
    to the model's device as it is and its items are the model's keyword arguments: `model(**batch)`, without
    the `labels` key unless `model.forward` names a `labels` parameter (Hugging Face models, which then
    compute their own loss). The loss is then:
    1. the output's `loss` (attribute or key) when it is a tensor;
    2. otherwise, of the output's logits (the output itself when it is a tensor, else its `logits` attribute
       or key, else its first tensor, depth first): a 0-dim one is the loss itself; with integer `labels` in
       the batch, the cross-entropy of the logits flattened over all but their last dimension against the
       flattened labels, `ignore_index=-100` as in Hugging Face; otherwise the mean of the logits.
    """
    device = next(model.parameters()).device
    transform = InputTransform(device, getattr(loader, "normalize", None), channels_last=False)
    pass_labels = _takes_labels(model)

    def loss_of(model: nn.Module, batch: Any) -> torch.Tensor:
        if isinstance(batch, Mapping):
            labels = batch.get("labels")
            out = model(**(batch if pass_labels else {k: v for k, v in batch.items() if k != "labels"}))
            return _mapping_loss(out, labels)
        inputs, targets = batch
        out = model(inputs)
        is_class = out.dim() == 2 and targets.dim() == 1 and not targets.is_floating_point()
        return F.cross_entropy(out, targets) if is_class else out.float().mean()

    def step(batch: Any) -> None:
        batch = move(batch, device) if isinstance(batch, Mapping) else transform(move(batch, device))
        forward_backward(model, batch, loss_of, nullcontext())
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

    The `model=` step takes `(inputs, targets)` batches (cross-entropy for class-index targets, else the
    output's mean) and Mapping batches, Hugging Face style: the batch goes to the model's device and in as
    keyword arguments, `model(**batch)`, less `labels` unless `model.forward` has a `labels` parameter. The
    loss is the output's `loss` (attribute or key) when there is one; otherwise, with integer `labels` in
    the batch, the cross-entropy (`ignore_index=-100`) of the logits (the output, its `logits`, or its first
    tensor) flattened over all but their last dimension, and otherwise their mean. A batch's samples are the
    leading dimension of its first tensor, depth first (`trainfast.samples.batch_samples`).

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
            timeline.on_phase_end = gain_probe(timeline, inst)
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
        report.notes.append("no step_fn or model: only the loader was measured"
                            + (f" ({report.samples_per_s:,.0f} samples/s)" if report.samples_per_s else ""))
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
