"""Precision, channels_last and torch.compile chosen by measurement on the run's own first steps.

Each practice left on "auto" starts from a prior read from the device (bf16 where the chip runs it natively,
NHWC for conv nets) and is then confirmed by an A/B: two settings alternate over real training steps (both
train the model, so no step is wasted, and the cost is only what the slower setting loses), each setting's
first step is discarded as warm-up, and the median of the rest decides. A mixed precision must also give the
same batch's loss as fp32 within `LOSS_TOLERANCE` before it can win. The compiled step must be faster and
neither recompile nor break its graph beyond the limits below.

The schedule is fixed: every A/B takes `CYCLES` steps, whatever its timings say. So two runs with the same seed
whose choices agree train the same steps in the same settings and end bit-identical, and under DDP every rank ends
each A/B at the same step. Every decision is taken on values all ranks agree on (`agree`: the element-wise max over
ranks, so a step's time is the slowest rank's, which is the job's, and a flag raised on one rank is raised on all):
no rank can decide alone and leave the others inside another collective.
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
from trainfast.loader.prefetch import rebuilt
from trainfast.oom import first_line, is_oom
from trainfast.precision.policy import DeviceCaps, PrecisionPolicy, resolve_precision
from trainfast.trainer.step import LossOf, forward_backward

log = logging.getLogger("trainfast")
TIMED = 3  # timed steps per setting, after its warm-up step: the median of 3 shrugs off one outlier
CYCLES = 2 * (1 + TIMED)  # optimizer steps one A/B takes, always (a timing-dependent end would make runs differ)
MARGIN = 0.03  # a setting that is not this much faster keeps the prior (for precision: fp32, the exact one)
# An A/B runs only in a run of at least this many times its steps: at most 1/6 of the run's steps are then taken
# in the slower setting, which costs ~3 % of the run when that setting is 1.2x slower (the bf16/fp32 ratio of the
# demo ConvNet on a 2-core AVX512-BF16 CPU is 1.5x).
MIN_RUN_MULTIPLE = 3
LOSS_TOLERANCE = 0.05  # the same batch's loss under a mixed precision vs fp32: relative difference allowed
RECOMPILE_LIMIT = 1  # frames recompiled during the measured compiled steps (guards failing step after step)
GRAPH_BREAK_LIMIT = 8  # each break runs eager code between graphs at every step
Agree = Callable[[list[float]], list[float]]  # each value's max over all ranks (the values themselves when alone)


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
    recompiles_after: int | None = None  # frames compiled after a compiled step was chosen (set when fit ends)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"chosen": self.chosen, "reason": self.reason, "measured": bool(self.step_s)}
        if self.practice == "compile":
            return out | {"eager_step_s": self.step_s.get("eager"), "compiled_step_s": self.step_s.get("compiled"),
                          "compile_s": self.compile_s, "recompiles": self.recompiles,
                          "graph_breaks": self.graph_breaks, "recompiles_after": self.recompiles_after}
        return out | {"step_s": self.step_s} | ({"loss": self.loss} if self.loss else {})


@dataclass
class _AB:
    practice: str
    settings: tuple[str, str]  # (prior, alternative): the prior runs first
    times: dict[str, list[float]] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)  # the alternative's step losses (finite check)
    cycle: int = 0
    guard: dict[str, float] = field(default_factory=dict)  # the first batch's loss per precision
    local_gap: float = 0.0  # relative gap of those two losses on this rank's batch (inf: the mixed one not finite)
    guard_gap: float = 0.0  # the largest over all ranks
    out_of_memory: str | None = None  # the alternative ran out of memory (precision: its first batch's probe)
    compile_s: float = 0.0  # the compiling step's time (a normal step's time is taken off at the decision)
    compile_error: str | None = None
    breaks_before: int = 0  # graph breaks counted before compiling
    frames_before: int | None = None  # frames compiled when the measured compiled steps began
    recompiles: int = 0  # agreed at the decision
    breaks: int = 0
    non_finite: bool = False  # an alternative's step loss was not finite (on any rank)

    def setting(self) -> str:
        """The setting this cycle trains in: the prior's and the alternative's cycles alternate."""
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
        self._eager_step_s: float | None = None
        self._frames_at_choice: int | None = None
        self._agree: Agree = lambda values: values
        self.on_settled: Callable[[], None] = lambda: None  # called when the last A/B has decided

    @property
    def measuring(self) -> bool:
        return bool(self._queue)

    def current(self) -> tuple[nn.Module, AbstractContextManager[object]]:
        """The model to call and the autocast to call it under, as the settings stand now."""
        return self.model, self.precision.autocast()

    def plan(self, eager: nn.Module, planned_steps: int, *, fresh: bool, distributed: bool, agree: Agree,
             saved: dict[str, str] | None = None) -> None:
        """Decide which A/Bs this run takes (on the fewest steps any rank plans). A resumed run takes none: it trains
        with what its start chose (`saved`, from the checkpoint), since another choice would change its results."""
        self.model = self.eager = eager
        self._agree = agree
        planned_steps = int(-agree([-float(planned_steps)])[0])  # the fewest any rank plans
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
                self._guard_precision(ab, batch, loss_of)
                if ab.out_of_memory is not None:  # fp32 cannot train here: decided now, on every rank
                    self._finish()
                    return self.begin(batch, loss_of, cycle_start=True) if self._queue else batch
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
        if ab.cycle == CYCLES:
            self._finish()

    def _finish(self) -> None:
        """The A/B at the head of the queue decides, on figures every rank agrees on; the next one starts."""
        choice = self._decide(self._agreed(self._queue.pop(0)))
        self._settle(choice)
        log.info("%s=%s: %s", choice.practice, choice.chosen, choice.reason)
        if self._queue:
            self._apply(self._queue[0].practice, self._queue[0].setting())
        else:
            self.on_settled()

    def _agreed(self, ab: _AB) -> _AB:
        """`ab` with the figures all ranks decide on: each timed step the slowest rank's (a DDP step waits for every
        rank, so that is the job's step time), each flag raised where any rank raised it. The fixed schedule gives
        every rank as many timings, so the values line up."""
        counts = dynamo_counts()
        recompiles = counts["frames"] - ab.frames_before if ab.frames_before is not None else 0
        timed = [ab.times.get(name, []) for name in ab.settings]
        local = [*timed[0], *timed[1], ab.guard_gap, float(ab.out_of_memory is not None),
                 float(ab.compile_error is not None), float(not all(math.isfinite(x) for x in ab.losses)),
                 float(recompiles), float(counts["graph_breaks"] - ab.breaks_before), ab.compile_s]
        agreed = self._agree(local)
        n0, n1 = len(timed[0]), len(timed[0]) + len(timed[1])
        gap, oom, failed, non_finite, recompiled, breaks, compile_s = agreed[n1:]
        times = {name: values for name, values in zip(ab.settings, (agreed[:n0], agreed[n0:n1]), strict=True)
                 if values}
        return replace(ab, times=times, guard_gap=gap, compile_s=compile_s, recompiles=int(recompiled),
                       breaks=int(breaks), non_finite=non_finite > 0,
                       out_of_memory=ab.out_of_memory or ("on another rank" if oom > 0 else None),
                       compile_error=ab.compile_error or ("compilation failed on another rank" if failed > 0 else None))

    # ------------------------------------------------------------------ decisions
    def _decide(self, ab: _AB) -> Choice:
        prior, alt = ab.settings
        medians = {name: statistics.median(ts) for name, ts in ab.times.items()}
        if ab.practice == "precision":
            return self._decide_precision(ab, medians)
        if ab.practice == "channels_last":
            ratio = medians[prior] / medians[alt]
            faster = ratio > 1 + MARGIN
            chosen = alt if faster else prior
            why = (f"{ratio:.2f}x the speed of {prior} here" if faster
                   else f"kept: {alt} ran at {ratio:.2f}x its speed (needs {1 + MARGIN:.2f}x)")
            return Choice("channels_last", chosen, f"{why} ({_ms(medians)}{_of(ab)})", medians)
        return self._decide_compile(ab, medians)

    def _decide_precision(self, ab: _AB, medians: dict[str, float]) -> Choice:
        mixed, fp32 = ab.settings
        if ab.out_of_memory is not None:
            return Choice("precision", mixed, f"kept {mixed}: fp32 ran out of memory on the first batch "
                                              f"({ab.out_of_memory})", {}, _guard_losses(ab))
        ratio = medians[fp32] / medians[mixed]
        figures = f"({_ms(medians)}{_of(ab)})"
        if ab.guard_gap > LOSS_TOLERANCE:
            off = "non-finite" if math.isinf(ab.guard_gap) else f"{ab.guard_gap:.1%} off"
            here = ab.local_gap == ab.guard_gap and fp32 in ab.guard
            losses = f"fp32: {ab.guard[fp32]:.4g}" if here else "on another rank's batch"
            return Choice("precision", fp32, f"refused {mixed}: its loss on the first batch is {off} ({losses}, "
                                             f"tolerance {LOSS_TOLERANCE:.0%}) {figures}", medians, _guard_losses(ab))
        if ratio > 1 + MARGIN:
            return Choice("precision", mixed, f"{ratio:.2f}x fp32's speed here, same-batch loss within "
                                              f"{LOSS_TOLERANCE:.0%} {figures}", medians, _guard_losses(ab))
        return Choice("precision", fp32, f"{mixed} was not {MARGIN:.0%} faster than fp32 here ({ratio:.2f}x): "
                                         f"fp32 kept, it is exact {figures}", medians, _guard_losses(ab))

    def _decide_compile(self, ab: _AB, medians: dict[str, float]) -> Choice:
        want = self.requested[2]
        if "eager" not in medians and self._eager_step_s is not None:  # a failed compile ended the A/B early
            medians = {"eager": self._eager_step_s, **medians}
        eager, compiled = medians.get("eager", math.nan), medians.get("compiled", math.nan)
        compile_s = max(0.0, ab.compile_s - eager) if math.isfinite(eager) else ab.compile_s  # less one step's time
        done = Choice("compile", "eager", "", medians, compile_s=compile_s, recompiles=ab.recompiles,
                      graph_breaks=ab.breaks)
        if ab.compile_error is not None:
            return replace(done, reason=f"compilation failed after {compile_s:.1f} s: {ab.compile_error}")
        figures = (f"eager {eager * 1e3:.1f} ms vs compiled {compiled * 1e3:.1f} ms per step, compile "
                   f"{compile_s:.1f} s; {ab.recompiles} recompiles, {ab.breaks} graph breaks")
        if want is True:
            return replace(done, chosen="compiled", reason=f"compile=True ({figures})")
        if ab.non_finite:
            why = "the compiled steps' loss was not finite"
        elif ab.recompiles > RECOMPILE_LIMIT:
            timed = len(ab.times.get("compiled", []))
            why = f"{ab.recompiles} recompiles over {timed} measured compiled steps (limit {RECOMPILE_LIMIT})"
        elif ab.breaks > GRAPH_BREAK_LIMIT:
            why = f"{ab.breaks} graph breaks (limit {GRAPH_BREAK_LIMIT})"
        elif not compiled < eager * (1 - MARGIN):
            why = f"not {MARGIN:.0%} faster than eager"
        else:  # the compile time is spent whatever is chosen now: only the steps ahead count
            return replace(done, chosen="compiled", reason=f"{eager / compiled:.2f}x eager's speed ({figures})")
        return replace(done, reason=f"{why} ({figures})")

    def finish(self) -> None:
        """When fit ends: frames compiled after a compiled step was chosen (an eval-mode validation, a last batch of
        another size) are each a compile the A/B did not see; reported in the compile block and logged."""
        choice = self.choices.get("compile")
        if choice is None or choice.chosen != "compiled" or self._frames_at_choice is None:
            return
        choice.recompiles_after = dynamo_counts()["frames"] - self._frames_at_choice
        if choice.recompiles_after:
            log.warning("torch.compile compiled %d more frame(s) after it was chosen (validation in eval mode, a last "
                        "batch of another size: drop_last=True, or torch._dynamo.mark_dynamic on the batch axis)",
                        choice.recompiles_after)

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
        if choice.practice == "compile" and choice.chosen == "compiled":
            if self.compiled is None:  # (resumed, or compile=True unmeasured: it compiles on its first step)
                self.compiled = cast(nn.Module, torch.compile(self.eager))
            else:  # compiled by the A/B: any frame compiled from now on is a recompile
                self._frames_at_choice = dynamo_counts()["frames"]
        self._apply(choice.practice, choice.chosen)

    def _policy(self, name: str) -> PrecisionPolicy:
        if name == "32-true":  # the fp32 contender keeps what "auto" decided for TF32 (free on Ampere and newer)
            return replace(resolve_precision("32-true", self.caps), tf32=self.precision.tf32,
                           reason="fp32 measured against mixed precision")
        return resolve_precision(name, self.caps) if name != self.precision.name else self.precision

    def _layout(self, channels_last: bool) -> None:
        """The model in this layout, and the optimizer's moments with it: an element-wise optimizer (AdamW) updates
        the same values in any layout, but a fused kernel walks a moment and its parameter by their strides (CPU's
        silently in the wrong order, CUDA's raises)."""
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        self.channels_last = channels_last
        self.module.to(memory_format=fmt)  # type: ignore[call-overload]
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() == 4 and value.shape == param.shape:
                    state[key] = value.contiguous(memory_format=fmt)

    def _guard_precision(self, ab: _AB, batch: Any, loss_of: LossOf) -> None:
        """The first batch's loss under each precision from the same weights, without a trace (no step, no statistics
        update; unwrapped, so no DDP collective): the mixed one must match fp32's. fp32's is taken with its backward,
        which also shows whether fp32 fits in memory (a batch size chosen under bf16 may not): if not, the prior
        stays."""
        mixed, fp32 = ab.settings
        with torch.no_grad(), _untouched(self.module, self.device), self._policy(mixed).autocast():
            ab.guard[mixed] = float(loss_of(self.module, batch).float())
        with _untouched(self.module, self.device):  # from the same random state: the same dropout masks
            try:
                loss = forward_backward(self.module, batch, loss_of, self._policy(fp32).autocast())
                ab.guard[fp32] = float(loss.detach().float())
            except Exception as e:
                if not is_oom(e):
                    raise
                ab.out_of_memory = first_line(e)[:200]
        ab.local_gap = ab.guard_gap = _relative_gap(ab.guard.get(mixed), ab.guard.get(fp32))
        if self._agree([float(ab.out_of_memory is not None)])[0] > 0 and ab.out_of_memory is None:
            ab.out_of_memory = "on another rank"

    def _compile(self, ab: _AB, batch: Any, loss_of: LossOf) -> None:
        """Compile and run one forward and backward on this batch, timed and without a trace (gradients, BatchNorm
        statistics and random streams put back): the compile time, and a compiled step that fails, or gives a loss
        or gradients eager does not, is caught before it can touch the weights. Inductor draws random numbers as
        eager does (`fallback_random`) for the compiled graph, so dropout gives both the same masks from the same
        random state and the loss comparison holds; the outcome is agreed by every rank."""
        ab.breaks_before = dynamo_counts()["graph_breaks"]
        with torch.no_grad(), _untouched(self.module, self.device), self.precision.autocast():
            eager_loss = float(loss_of(self.module, batch).float())
        self._clock.start()
        finite, loss = True, math.nan
        try:
            from torch._inductor import config as inductor_config

            self.compiled = cast(nn.Module, torch.compile(self.eager))
            with _untouched(self.module, self.device), inductor_config.patch(fallback_random=True):
                # the Trainer's step, unscaled on purpose: the check is of finite gradients, and fp16's first scaled
                # ones may overflow (the scaler's business, not a compile defect)
                out = forward_backward(self.compiled, batch, loss_of, self.precision.autocast())
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
        if self._agree([float(ab.compile_error is not None)])[0] > 0 and ab.compile_error is None:
            ab.compile_error, self.compiled = "compilation failed on another rank", None

    def to_json(self) -> dict[str, Any]:
        return {name: choice.to_json() for name, choice in self.choices.items()}


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


def _relative_gap(loss: float | None, reference: float | None) -> float:
    """How far `loss` is from the reference loss of the same batch, relative to it (a near-zero reference counts as
    0.01); inf when `loss` is not finite, 0 when there is nothing to compare with (no finite reference)."""
    if loss is None or reference is None or not math.isfinite(reference):
        return 0.0
    if not math.isfinite(loss):
        return math.inf
    return abs(loss - reference) / max(abs(reference), 0.01)


def _loss_gap(loss: float | None, reference: float | None) -> str | None:
    """How far `loss` is from the reference loss of the same batch, when beyond `LOSS_TOLERANCE` (None: within)."""
    gap = _relative_gap(loss, reference)
    if gap <= LOSS_TOLERANCE or loss is None or reference is None:
        return None
    return "non-finite" if math.isinf(gap) else f"{abs(loss - reference) / max(abs(reference), 1e-12):.1%} off"


def _guard_losses(ab: _AB) -> dict[str, float]:
    """The first batch's loss per precision, as reported (this rank's batch)."""
    return {name: ab.guard[name] for name in ab.settings if name in ab.guard}


def _inputs_as(batch: Any, fmt: torch.memory_format) -> Any:
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor) and batch[0].dim() == 4:
        return rebuilt(batch, [batch[0].contiguous(memory_format=fmt), *batch[1:]])
    return batch


def _of(ab: _AB) -> str:
    return f", median of {min(len(ts) for ts in ab.times.values()) if ab.times else 0}"


def _layout(channels_last: bool) -> str:
    return "channels_last" if channels_last else "contiguous"


def _ms(medians: dict[str, float]) -> str:
    return " vs ".join(f"{name} {s * 1e3:.1f} ms" for name, s in medians.items())
