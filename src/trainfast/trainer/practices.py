"""Precision, channels_last and torch.compile chosen by measurement on the run's own first steps.

Each practice left on "auto" starts from a prior read from the device (bf16 where the chip runs it natively,
NHWC for conv nets) and is then confirmed by an A/B: two settings alternate over real training steps (both
train the model, so no step is wasted, and the cost is only what the slower setting loses), each setting's
first step is discarded as warm-up, and the median of the rest decides. A mixed precision must also give the
same batch's loss as fp32 within `LOSS_TOLERANCE` before it can win. The compiled step must be faster, repay
its compile time within the run, and neither recompile nor break its graph beyond the limits below.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from torch import nn

from trainfast.device import DeviceClock
from trainfast.dynamo import dynamo_counts
from trainfast.precision.policy import DeviceCaps, PrecisionPolicy, resolve_precision
from trainfast.trainer.step import LossOf

log = logging.getLogger("trainfast")
TIMED = 3  # timed steps per setting, after its warm-up step: the median of 3 shrugs off one outlier
CYCLES = 2 * (1 + TIMED)  # optimizer steps one A/B takes at most
# The prior is confirmed after one timed step each when it is this much faster: overturning it takes all TIMED
# steps, confirming it by a wide margin need not (the slower setting's steps are the A/B's cost: ~5 % of the
# quick demo's 75 steps with both A/Bs run in full, half that when they end early).
CONFIRM_EARLY = 1.3
MARGIN = 0.03  # a setting that is not this much faster keeps the prior (for precision: fp32, the exact one)
# An A/B runs only in a run of at least this many times its steps: at most 1/6 of the run's steps are then taken
# in the slower setting, which costs ~3 % of the run when that setting is 1.2x slower (the bf16/fp32 ratio of the
# demo ConvNet on a 2-core AVX512-BF16 CPU is 1.5x).
MIN_RUN_MULTIPLE = 3
LOSS_TOLERANCE = 0.05  # the same batch's loss under a mixed precision vs fp32: relative difference allowed
RECOMPILE_LIMIT = 1  # frames recompiled during the measured compiled steps (guards failing step after step)
GRAPH_BREAK_LIMIT = 8  # each break runs eager code between graphs at every step


@dataclass
class Choice:
    """What one A/B decided, with its figures (JSON-ready through `to_json`)."""

    practice: str  # "precision" | "channels_last" | "compile"
    chosen: str
    reason: str
    step_s: dict[str, float] = field(default_factory=dict)  # median step time per measured setting
    loss: dict[str, float] = field(default_factory=dict)  # the first batch's loss per precision (the guard)
    compile_s: float | None = None
    recompiles: int | None = None
    graph_breaks: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"chosen": self.chosen, "reason": self.reason, "measured": bool(self.step_s)}
        if self.practice == "compile":
            return out | {"eager_step_s": self.step_s.get("eager"), "compiled_step_s": self.step_s.get("compiled"),
                          "compile_s": self.compile_s, "recompiles": self.recompiles,
                          "graph_breaks": self.graph_breaks}
        return out | {"step_s": self.step_s} | ({"loss": self.loss} if self.loss else {})


@dataclass
class _AB:
    practice: str
    settings: tuple[str, str]  # (prior, alternative): the prior runs first
    times: dict[str, list[float]] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)  # the alternative's step losses (finite check)
    cycle: int = 0
    guard: dict[str, float] = field(default_factory=dict)  # the first batch's loss per precision
    compile_s: float = 0.0  # the compiling step's time (a normal step's time is taken off at the decision)
    compile_error: str | None = None
    breaks_before: int = 0  # graph breaks counted before compiling
    frames_before: int | None = None  # frames compiled when the measured compiled steps began

    def setting(self) -> str:
        return self.settings[self.cycle % 2]


class Practices:
    """The settings the loop trains with (`precision`, `channels_last`, the model to call) and the A/Bs still to
    run. The loop calls `begin` before and `end` after each micro-batch while `measuring` is true."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, caps: DeviceCaps,
                 precision: PrecisionPolicy, channels_last: bool, *, requested_precision: str,
                 requested_channels_last: bool | str, requested_compile: bool | str) -> None:
        self.module, self.optimizer, self.device, self.caps = model, optimizer, device, caps
        self.precision, self.channels_last = precision, channels_last
        self.requested = (requested_precision, requested_channels_last, requested_compile)
        self.model: nn.Module = model  # what the loop calls: the (DDP-wrapped) model, or its compiled form
        self.eager: nn.Module = model
        self.compiled: nn.Module | None = None
        self.choices: dict[str, Choice] = {}
        self._queue: list[_AB] = []
        self._clock = DeviceClock(device)
        self._cycle_s = 0.0
        self._planned = 0
        self._steps = 0
        self._eager_step_s: float | None = None
        self._agree: Callable[[Any], Any] = lambda x: x

    @property
    def measuring(self) -> bool:
        return bool(self._queue)

    def current(self) -> tuple[nn.Module, AbstractContextManager[object]]:
        """The model to call and the autocast to call it under, as the settings stand now."""
        return self.model, self.precision.autocast()

    def plan(self, eager: nn.Module, planned_steps: int, *, fresh: bool, distributed: bool,
             agree: Callable[[Any], Any], saved: dict[str, str] | None = None) -> None:
        """Decide which A/Bs this run takes. A resumed run takes none: it trains with what its start chose
        (`saved`, from the checkpoint), since another choice would change its results."""
        self.model = self.eager = eager
        self._planned, self._agree = planned_steps, agree
        want_precision, want_layout, want_compile = self.requested
        saved = saved or {}
        affordable = fresh and planned_steps >= MIN_RUN_MULTIPLE * CYCLES
        unmeasured = ("resumed run, no choice saved" if not fresh else f"not measured: run of {planned_steps} "
                      f"steps, under {MIN_RUN_MULTIPLE}x the {CYCLES} steps an A/B takes")
        kept = "chosen when this run started (kept on resume)"
        mixed = self.precision.autocast_dtype is not None
        if want_precision == "auto" and "precision" in saved:
            self._settle(Choice("precision", saved["precision"], kept))
        elif want_precision == "auto" and mixed and not self.precision.needs_scaler and affordable:
            self._queue.append(_AB("precision", (self.precision.name, "32-true")))
        else:  # (fp16 on a GPU without bf16: fp32 is no contender for its tensor cores)
            measurable = want_precision == "auto" and mixed and not self.precision.needs_scaler
            why = f"{self.precision.reason}; {unmeasured}" if measurable else self.precision.reason
            self._settle(Choice("precision", self.precision.name, why))

        has_conv = any(isinstance(m, nn.Conv2d) for m in self.module.modules())
        if want_layout == "auto" and "channels_last" in saved:
            self._settle(Choice("channels_last", saved["channels_last"], kept))
        elif want_layout == "auto" and has_conv and affordable and not distributed:
            self._queue.append(_AB("channels_last", ("channels_last", "contiguous") if self.channels_last
                                   else ("contiguous", "channels_last")))
        else:  # (DDP's gradient buckets are views in the parameters' layout: no switching under it)
            why = ("requested" if want_layout != "auto" else "no Conv2d layer" if not has_conv
                   else "not measured under DDP" if distributed else unmeasured)
            self._settle(Choice("channels_last", _layout(self.channels_last), why))

        if want_compile is False:
            self._settle(Choice("compile", "eager", "compile=False"))
        elif want_compile == "auto" and "compile" in saved:
            self._settle(Choice("compile", saved["compile"], kept))
        elif fresh and planned_steps >= (len(self._queue) + 1) * CYCLES:
            self._queue.append(_AB("compile", ("eager", "compiled")))
        elif want_compile is True:
            self._settle(Choice("compile", "compiled", "compile=True; not measured: run too short or resumed"))
        else:
            self._settle(Choice("compile", "eager", f"not measured: run of {planned_steps} steps is too short to "
                                                    "time a compiled step" if fresh else unmeasured))
        if self._queue:
            self._apply(self._queue[0].practice, self._queue[0].setting())

    def saved(self) -> dict[str, str]:
        """The choices, for the checkpoint: a resumed run trains with them."""
        return {name: choice.chosen for name, choice in self.choices.items()}

    # ------------------------------------------------------------------ per micro-batch, while measuring
    def begin(self, batch: Any, loss_of: LossOf, *, cycle_start: bool) -> Any:
        """Before a micro-batch: switch to this cycle's setting at a cycle start; the batch in its layout."""
        ab = self._queue[0]
        if cycle_start:
            self._cycle_s = 0.0
            if ab.practice == "precision" and ab.cycle == 0:
                ab.guard = self._same_batch_losses(batch, loss_of, ab.settings)
            if ab.practice == "compile" and ab.cycle == 1:
                self._compile(ab, batch, loss_of)
                if ab.compile_error is not None:  # nothing compiled to time: decided now, this step is eager
                    self._finish()
                    return self.begin(batch, loss_of, cycle_start=True) if self._queue else batch
            self._apply(ab.practice, ab.setting())
        if ab.practice == "channels_last":
            batch = _inputs_as(batch, torch.channels_last if ab.setting() == "channels_last"
                               else torch.contiguous_format)
        self._clock.start()
        return batch

    def end(self, loss: torch.Tensor, *, boundary: bool) -> None:
        """After a micro-batch: its time (the device synchronised); at a cycle's end, maybe a decision."""
        self._cycle_s += self._clock.elapsed()
        if not boundary:
            return
        ab = self._queue[0]
        if ab.cycle >= 2:  # each setting's first cycle warmed it up
            ab.times.setdefault(ab.setting(), []).append(self._cycle_s)
            if ab.setting() == ab.settings[1]:
                ab.losses.append(float(loss.detach().float()))
        if ab.practice == "compile" and ab.cycle == 2:
            ab.frames_before = dynamo_counts()["frames"]  # recompiles count from the measured compiled steps on
        ab.cycle += 1
        self._steps += 1
        if ab.cycle == CYCLES or (ab.cycle == 4 and _confirmed_early(ab)):
            self._finish()

    def _finish(self) -> None:
        """The A/B at the head of the queue decides (rank 0's decision on every rank); the next one starts."""
        choice = self._agree(self._decide(self._queue.pop(0)))
        self._settle(choice)
        log.info("%s=%s: %s", choice.practice, choice.chosen, choice.reason)
        if self._queue:
            self._apply(self._queue[0].practice, self._queue[0].setting())

    # ------------------------------------------------------------------ decisions
    def _decide(self, ab: _AB) -> Choice:
        prior, alt = ab.settings
        medians = {name: statistics.median(ts) for name, ts in ab.times.items()}
        ratio = medians[prior] / medians[alt] if medians.get(alt) else math.nan
        if ab.practice == "precision":
            return self._decide_precision(ab, medians)
        if ab.practice == "channels_last":
            faster = ratio > 1 + MARGIN
            chosen = alt if faster else prior
            why = (f"{ratio:.2f}x the speed of {prior} here" if faster
                   else f"kept: {alt} ran at {ratio:.2f}x its speed (needs {1 + MARGIN:.2f}x)")
            return Choice("channels_last", chosen, f"{why} ({_ms(medians)}{_of(ab)})", medians)
        return self._decide_compile(ab, medians)

    def _decide_precision(self, ab: _AB, medians: dict[str, float]) -> Choice:
        mixed, fp32 = ab.settings
        ratio = medians[fp32] / medians[mixed]
        figures = f"({_ms(medians)}{_of(ab)})"
        off = _loss_gap(ab.guard.get(mixed), ab.guard.get(fp32))
        if off is not None:
            return Choice("precision", fp32, f"refused {mixed}: its loss on the first batch is {off} (fp32: "
                                             f"{ab.guard[fp32]:.4g}, tolerance {LOSS_TOLERANCE:.0%}) {figures}",
                          medians, ab.guard)
        if ratio > 1 + MARGIN:
            return Choice("precision", mixed, f"{ratio:.2f}x fp32's speed here, same-batch loss within "
                                              f"{LOSS_TOLERANCE:.0%} {figures}", medians, ab.guard)
        return Choice("precision", fp32, f"{mixed} was not {MARGIN:.0%} faster than fp32 here ({ratio:.2f}x): "
                                         f"fp32 kept, it is exact {figures}", medians, ab.guard)

    def _decide_compile(self, ab: _AB, medians: dict[str, float]) -> Choice:
        want = self.requested[2]
        now = dynamo_counts()
        recompiles = now["frames"] - (now["frames"] if ab.frames_before is None else ab.frames_before)
        breaks = now["graph_breaks"] - ab.breaks_before
        if "eager" not in medians and self._eager_step_s is not None:  # a failed compile ended the A/B early
            medians = {"eager": self._eager_step_s, **medians}
        eager, compiled = medians.get("eager", math.nan), medians.get("compiled", math.nan)
        compile_s = max(0.0, ab.compile_s - eager) if math.isfinite(eager) else ab.compile_s  # less one step's time
        done = Choice("compile", "eager", "", medians, compile_s=compile_s, recompiles=recompiles,
                      graph_breaks=breaks)
        if ab.compile_error is not None:
            return replace(done, reason=f"compilation failed after {compile_s:.1f} s: {ab.compile_error}")
        left = max(0, self._planned - self._steps)
        saved = (eager - compiled) * left
        figures = (f"eager {eager * 1e3:.1f} ms vs compiled {compiled * 1e3:.1f} ms per step, compile "
                   f"{compile_s:.1f} s = {compile_s / max(self._planned, 1) * 1e3:.1f} ms a step over "
                   f"{self._planned} steps; "
                   f"{recompiles} recompiles, {breaks} graph breaks")
        if want is True:
            return replace(done, chosen="compiled", reason=f"compile=True ({figures})")
        if not all(math.isfinite(x) for x in ab.losses):
            why = "the compiled steps' loss was not finite"
        elif recompiles > RECOMPILE_LIMIT:
            timed = len(ab.times.get("compiled", []))
            why = f"{recompiles} recompiles over {timed} measured compiled steps (limit {RECOMPILE_LIMIT})"
        elif breaks > GRAPH_BREAK_LIMIT:
            why = f"{breaks} graph breaks (limit {GRAPH_BREAK_LIMIT})"
        elif not compiled < eager * (1 - MARGIN):
            why = f"not {MARGIN:.0%} faster than eager"
        elif saved < compile_s:
            why = f"saves {saved:.1f} s over the {left} steps left, less than its compile time"
        else:
            return replace(done, chosen="compiled", reason=f"{eager / compiled:.2f}x eager's speed, repays its "
                                                           f"compile time within the run ({figures})")
        return replace(done, reason=f"{why} ({figures})")

    # ------------------------------------------------------------------ settings
    def _apply(self, practice: str, setting: str) -> None:
        if practice == "precision":
            self.precision = self._policy(setting)
        elif practice == "channels_last":
            self._layout(setting == "channels_last")
        elif practice == "compile":
            self.model = self.compiled if setting == "compiled" and self.compiled is not None else self.eager

    def _settle(self, choice: Choice) -> None:
        self.choices[choice.practice] = choice
        if choice.chosen in choice.step_s and choice.practice != "compile":
            self._eager_step_s = choice.step_s[choice.chosen]  # the eager step, as the settings now stand
        if choice.practice == "compile" and choice.chosen == "compiled" and self.compiled is None:
            self.compiled = cast(nn.Module, torch.compile(self.eager))
        self._apply(choice.practice, choice.chosen)
        if choice.practice == "channels_last":
            self._convert_optimizer_state()

    def _policy(self, name: str) -> PrecisionPolicy:
        if name == "32-true":  # the fp32 contender keeps what "auto" decided for TF32 (free on Ampere and newer)
            return replace(resolve_precision("32-true", self.caps), tf32=self.precision.tf32,
                           reason="fp32 measured against mixed precision")
        return resolve_precision(name, self.caps) if name != self.precision.name else self.precision

    def _layout(self, channels_last: bool) -> None:
        self.channels_last = channels_last
        self.module.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)  # type: ignore[call-overload]

    def _convert_optimizer_state(self) -> None:
        """Moments made while the parameters had the other layout take theirs (element-wise state: same values)."""
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() == 4 and value.shape == param.shape:
                    state[key] = value.contiguous(memory_format=fmt)

    def _compile(self, ab: _AB, batch: Any, loss_of: LossOf) -> None:
        """Compile and run one forward and backward on this batch, timed and without a trace (gradients, BatchNorm
        statistics and random streams put back): the compile time, and a compiled step that fails, or gives a loss
        or gradients eager does not, is caught before it can touch the weights."""
        ab.breaks_before = dynamo_counts()["graph_breaks"]
        with torch.no_grad(), _untouched(self.module, self.device), self.precision.autocast():
            eager_loss = float(loss_of(self.module, batch).float())
        self._clock.start()
        try:
            self.compiled = cast(nn.Module, torch.compile(self.eager))
            with _untouched(self.module, self.device):
                with self.precision.autocast():
                    out = loss_of(self.compiled, batch)
                out.backward()
                grads = [p.grad for p in self.module.parameters() if p.grad is not None]
                finite = all(bool(torch.isfinite(g).all()) for g in grads)
            loss = float(out.detach().float())  # (synchronises)
        except Exception as e:  # any failure to compile means eager, with the reason
            if self.requested[2] is True:
                raise
            first = str(e).splitlines()[0] if str(e) else ""
            ab.compile_error, self.compiled = f"{type(e).__name__}: {first}"[:300], None
        ab.compile_s = self._clock.elapsed()
        off = _loss_gap(loss, eager_loss) if ab.compile_error is None else None
        if ab.compile_error is None and (off is not None or not finite):
            wrong = (f"a loss that is {off} (eager: {eager_loss:.4g}, same batch)" if off is not None
                     else "non-finite gradients where eager's are finite")
            if self.requested[2] is True:
                raise RuntimeError(f"compile=True: the compiled step gives {wrong} (a torch.compile defect for "
                                   f"this model at {self.precision.name}); use compile='auto' (falls back to eager) "
                                   "or False")
            ab.compile_error, self.compiled = f"the compiled step gave {wrong}", None

    def _same_batch_losses(self, batch: Any, loss_of: LossOf, names: tuple[str, str]) -> dict[str, float]:
        """The batch's loss under each precision from the same weights (no step, no statistics update)."""
        losses = {}
        with torch.no_grad(), _untouched(self.module, self.device):
            for name in names:
                with self._policy(name).autocast():
                    losses[name] = float(loss_of(self.module, batch).float())  # unwrapped: no DDP collective
        return losses

    def to_json(self) -> dict[str, Any]:
        return {name: choice.to_json() for name, choice in self.choices.items()}


def resolve_channels_last(setting: bool | str, model: nn.Module, device: torch.device, mixed: bool) -> bool:
    """'auto': NHWC for conv nets on the CPU (oneDNN's fast layout: 1.6x on the demo ConvNet here) or with
    mixed precision on CUDA (tensor cores read NHWC); plain fp32 CUDA convs gain little and can lose."""
    if setting != "auto":
        return bool(setting)
    has_conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
    chosen = has_conv and (device.type == "cpu" or mixed)
    if has_conv:
        log.info("channels_last=%s (conv net, %s%s)", chosen, device.type, ", mixed precision" if mixed else "")
    return chosen


class _untouched:
    """Run extra forward passes without a trace: BatchNorm statistics, gradients and random streams put back."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.module, self.device = module, device

    def __enter__(self) -> None:
        self.buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        self.grads = [(p, p.grad) for p in self.module.parameters()]
        self.rng = torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else [])
        self.rng.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.rng.__exit__(None, None, None)
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        for param, grad in self.grads:
            param.grad = grad


def _loss_gap(loss: float | None, reference: float | None) -> str | None:
    """How far `loss` is from the reference loss of the same batch, when beyond `LOSS_TOLERANCE` (None: within)."""
    if loss is None or reference is None or not math.isfinite(reference):
        return None
    if not math.isfinite(loss):
        return "non-finite"
    gap = abs(loss - reference)  # relative, but a near-zero loss is compared at an absolute 0.01 * tolerance
    return f"{gap / max(abs(reference), 1e-12):.1%} off" if gap > LOSS_TOLERANCE * max(abs(reference), 0.01) else None


def _inputs_as(batch: Any, fmt: torch.memory_format) -> Any:
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor) and batch[0].dim() == 4:
        return type(batch)((batch[0].contiguous(memory_format=fmt), *batch[1:]))
    return batch


def _confirmed_early(ab: _AB) -> bool:
    """After one timed step of each setting: is the prior at least `CONFIRM_EARLY` times as fast?"""
    prior, alt = (ab.times.get(name, [math.nan])[0] for name in ab.settings)
    return prior * CONFIRM_EARLY <= alt


def _of(ab: _AB) -> str:
    n = min(len(ts) for ts in ab.times.values()) if ab.times else 0
    return ", one step each: the prior confirmed early" if n == 1 else f", median of {n}"


def _layout(channels_last: bool) -> str:
    return "channels_last" if channels_last else "contiguous"


def _ms(medians: dict[str, float]) -> str:
    return " vs ".join(f"{name} {s * 1e3:.1f} ms" for name, s in medians.items())
