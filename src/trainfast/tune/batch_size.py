"""`find_batch_size`: the largest batch whose training step (forward + backward) fits in device memory.

Search: double from `start` until the first out-of-memory error (or `max_batch`), then bisect between the
last batch that fit and the first that did not, until the gap is at most `RESOLUTION` (5 %) of the batch
that fit (at least 1). The answer is therefore a batch that fitted, within 5 % of the largest that would.

Only out-of-memory errors end a try; anything else propagates unchanged. Between tries the gradients are
freed, garbage collected and, on CUDA, the allocator's cache emptied, so one try's leftovers do not make
the next one fail. The model keeps its train/eval modes, buffers (BatchNorm statistics) and device, and
ends with no gradients.

Not measured: optimizer state (AdamW keeps two tensors per parameter) unless it already exists on the
device, and memory other processes take later. The result's `advice` says how much headroom to leave.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainfast.device import DeviceClock, free_memory, resolve_device, synchronize
from trainfast.oom import MemorySnapshot, first_line, fragmentation_advice, fragmented, is_oom
from trainfast.oom import memory_at_oom as _memory_at_oom  # a module global: tests fake it
from trainfast.oom import requested_bytes as _requested_bytes
from trainfast.precision.policy import PrecisionPolicy, device_caps, resolve_precision
from trainfast.trainer.step import LossOf, default_batch_loss, forward_backward, renamed_step_fn
from trainfast.units import format_bytes

log = logging.getLogger("trainfast")
Sample = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

# Bisection stops when the gap between the largest fit and the smallest failure is at most this share of
# the fit (and at least 1): each halving costs a full training step at a large batch, and the last 5 %
# is within what other processes and the optimizer's state move anyway.
RESOLUTION = 0.05


class BatchSizeError(RuntimeError):
    """Even a batch of one sample does not fit in memory."""


@dataclass(frozen=True)
class BatchSizeResult:
    batch_size: int  # the largest batch that fit
    tried: tuple[tuple[int, bool, float], ...]  # (batch size, fitted, seconds), in the order tried
    first_oom: int | None  # the first batch that ran out of memory; None if max_batch fit
    fragmentation_suspected: bool
    advice: str  # what to do next, one point per line
    device: str
    precision: str

    def to_json(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size,
                "tried": [{"batch_size": b, "fitted": ok, "seconds": s} for b, ok, s in self.tried],
                "first_oom": self.first_oom, "fragmentation_suspected": self.fragmentation_suspected,
                "advice": self.advice, "device": self.device, "precision": self.precision}


def find_batch_size(model: nn.Module, sample: Sample, *, precision: str = "auto", device: str = "auto",
                    start: int = 8, max_batch: int = 4096, batch_loss: LossOf | None = None,
                    step_fn: LossOf | None = None) -> BatchSizeResult:
    """The largest batch size (within `RESOLUTION`) for which a training step of `model` fits in memory.

    `sample` is one input without the batch dimension, or `(input, target)`; batches repeat it (as the
    model would receive it: float and normalised). The loss is the Trainer's (`default_batch_loss`), or without a
    target the output's mean. `batch_loss(model, batch) -> loss` replaces that: its
    batch is `(inputs, targets)` for a pair, else the inputs tensor; the backward pass is done here.
    Forward and loss run under the resolved precision's autocast (no loss scaling: it does not change
    memory). The model is moved to `device` for the search and back afterwards; existing gradients are
    cleared. Optimizer state counts only if it already exists on the device (create it with one step
    first to include it). On the CPU the kernel may kill the process instead of failing an allocation,
    so keep `max_batch` modest there.
    """
    batch_loss = renamed_step_fn(batch_loss, step_fn)
    _check_arguments(model, sample, start, max_batch, batch_loss)
    dev = resolve_device(device)
    policy = resolve_precision(precision, device_caps(dev))
    inputs, targets = sample if isinstance(sample, tuple) else (sample, None)
    x, y = inputs.to(dev), None if targets is None else targets.to(dev)  # one sample: small
    shape = _describe(sample)
    tried: list[tuple[int, bool, float]] = []
    suspect: tuple[int, MemorySnapshot] | None = None
    last_oom = ""

    clock = DeviceClock(dev)

    def fits(batch: int) -> bool:
        nonlocal suspect, last_oom
        clock.start()  # the model's and the sample's copies to the device are not this try's time
        try:
            _train_step(model, x, y, batch, policy, batch_loss)
            ok = True
        except Exception as e:
            if not is_oom(e):
                raise
            ok = False
            last_oom = first_line(e)
            # Read while the failed step's tensors are still referenced: the state the allocator failed in.
            memory = _memory_at_oom(dev)
            if suspect is None and memory is not None and fragmented(memory, _requested_bytes(str(e))):
                suspect = (batch, memory)
        finally:
            seconds = clock.elapsed()  # the step alone, not the clean-up below
            model.zero_grad(set_to_none=True)
            free_memory(dev)
        tried.append((batch, ok, seconds))
        log.info("batch size search: %d %s (%.2f s)", batch, "fits" if ok else "out of memory", seconds)
        return ok

    with _model_prepared(model, dev):
        best, first_oom = search(fits, start, max_batch)
    if best == 0:
        raise BatchSizeError(f"even a batch of 1 does not fit in memory on {dev} for a training step of "
                             f"{type(model).__name__} on a sample of shape {shape} (precision {policy.name}): "
                             f"{last_oom}. Free memory other processes hold, train in lower precision "
                             "('bf16-mixed' on recent GPUs), use activation checkpointing or a smaller model")
    advice = _advice(model, max_batch, first_oom, suspect)
    log.info("batch size search: %d is the largest that fits on %s (%s; first OOM at %s; %d tries)", best, dev,
             policy.name, first_oom, len(tried))
    for line in advice.splitlines():
        log.info("batch size search: %s", line)
    return BatchSizeResult(batch_size=best, tried=tuple(tried), first_oom=first_oom,
                           fragmentation_suspected=suspect is not None, advice=advice, device=str(dev),
                           precision=policy.name)


def search(fits: Callable[[int], bool], start: int, max_batch: int) -> tuple[int, int | None]:
    """(largest batch that fit or 0, first batch that failed or None): doubling, then bisection.

    Assumes memory grows with the batch (a batch above one that failed fails too).
    """
    good, bad, batch = 0, None, start
    while True:
        if not fits(batch):
            bad = batch
            break
        good = batch
        if batch >= max_batch:
            return good, None
        batch = min(2 * batch, max_batch)
    first_oom = bad
    while bad - good > max(1, int(good * RESOLUTION)):
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good, first_oom


def _train_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor | None, batch: int,
                policy: PrecisionPolicy, batch_loss: LossOf | None) -> None:
    """One forward + backward on `batch` copies of the sample; its tensors die when it returns or raises."""
    x = _repeat(inputs, batch)
    y = None if targets is None else _repeat(targets, batch)
    with torch.enable_grad():
        forward_backward(model, x if y is None else (x, y),
                         batch_loss or (_outputs_mean if y is None else default_batch_loss), policy.autocast())
    synchronize(x.device)  # an asynchronous failure belongs to this try, and so does its time


def _outputs_mean(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """The loss of a sample given without targets: the output's mean (what the search measures is the memory of a
    forward and its backward, which no other loss changes)."""
    return torch.as_tensor(model(inputs)).float().mean()


def _repeat(sample: torch.Tensor, batch: int) -> torch.Tensor:
    # A real copy, not an expanded view: a loaded batch occupies batch × sample bytes.
    return sample.detach().unsqueeze(0).expand(batch, *sample.shape).contiguous()


@contextmanager
def _model_prepared(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Train mode on `device` for the search; afterwards each module's mode, the buffers, the device and no grads."""
    modes = [(m, m.training) for m in model.modules()]
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    # Mixed devices (model parallel) are the caller's layout: leave them as they are.
    home = devices.pop() if len(devices) == 1 else None
    move = home is not None and home != device
    # A training forward updates BatchNorm statistics; copies of one sample would skew them. By name:
    # `.to()` replaces buffer tensors.
    buffers = [(name, b.detach().to("cpu", copy=True)) for name, b in model.named_buffers()]
    model.zero_grad(set_to_none=True)  # stale gradients would count as this step's memory
    try:
        if move:
            model.to(device)
        model.train()
        yield
    finally:
        model.zero_grad(set_to_none=True)
        for module, training in modes:
            module.train(training)
        if move:
            model.to(home)
        with torch.no_grad():
            for name, saved in buffers:
                model.get_buffer(name).copy_(saved)
        free_memory(device)


def _advice(model: nn.Module, max_batch: int, first_oom: int | None,
            suspect: tuple[int, MemorySnapshot] | None) -> str:
    lines = []
    if first_oom is None:
        lines.append(f"no out-of-memory error up to max_batch={max_batch}: raise max_batch to search further")
    if suspect is not None:
        batch, memory = suspect
        lines.append(f"at the OOM for batch {batch}, {fragmentation_advice(memory)}")
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    lines.append(f"not counted unless already on the device: optimizer state (AdamW: 2 × {format_bytes(trainable)} "
                 "for this model); leave that headroom or take one optimizer step before searching")
    return "\n".join(lines)


def _describe(sample: Sample) -> str:
    if isinstance(sample, tuple):
        return f"{tuple(sample[0].shape)} with target {tuple(sample[1].shape)}"
    return str(tuple(sample.shape))


def _check_arguments(model: object, sample: object, start: object, max_batch: object, batch_loss: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    pair = isinstance(sample, tuple) and len(sample) == 2 and all(isinstance(t, torch.Tensor) for t in sample)
    if not (isinstance(sample, torch.Tensor) or pair):
        raise TypeError(f"sample must be one tensor without the batch dimension or a tuple (input, target) of "
                        f"tensors; got {type(sample).__name__}. Pass e.g. dataset[0]")
    for name, value in (("start", start), ("max_batch", max_batch)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name}={value!r} must be an int")
    assert isinstance(start, int) and isinstance(max_batch, int)
    if start < 1:
        raise ValueError(f"start={start} is not valid: the search starts from a batch of at least 1; pass start=1 "
                         "or more")
    if max_batch < start:
        raise ValueError(f"max_batch={max_batch} is smaller than start={start}; pass max_batch >= {start} or a "
                         "smaller start")
    if batch_loss is not None and not callable(batch_loss):
        raise TypeError(f"batch_loss must be callable as batch_loss(model, batch) -> loss; got "
                        f"{type(batch_loss).__name__}")
