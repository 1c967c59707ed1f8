"""The Trainer's speed practices, one class each, and `PRACTICES`, the one list that registers them.

- `Precision`: the prior is bf16 where the chip runs it natively; measured against fp32, a mixed precision must also
  give the same batch's loss as fp32 within `LOSS_TOLERANCE` before it can win, and keeps the prior when fp32 does
  not fit in memory.
- `ChannelsLast`: NHWC for conv nets; measured against the other layout, never under DDP.
- `Compile`: eager against torch.compile's step, which must be faster and neither recompile nor break its graph
  beyond the limits below.

Every comparison of speeds is `trainfast.decide`'s on the A/B's agreed step times (`practice.decision`): a setting
wins only when measured faster by its margin (`FASTER`, 3 %) beyond the steps' noise; "cannot tell" keeps the safe
setting.
A new practice is a subclass of `Practice` (`trainer/practice.py`) added to `PRACTICES`, with its setting in
`TrainConfig`; the order of `PRACTICES` is the order its A/Bs run in (compile last: its plan counts those before).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from torch import nn

from trainfast.device import DeviceClock
from trainfast.dynamo import dynamo_counts
from trainfast.loader.prefetch import rebuilt
from trainfast.oom import first_line, is_oom
from trainfast.precision.policy import PrecisionPolicy, resolve_precision
from trainfast.trainer.config import TrainConfig
from trainfast.trainer.practice import (
    AB,
    FIRST_TIMED,
    LOSS_TOLERANCE,
    MAX_STEPS,
    Choice,
    Plan,
    Practice,
    Settings,
    decision,
    in_ms,
    loss_gap,
    median_times,
    relative_gap,
    untouched,
)
from trainfast.trainer.step import LossOf, forward_backward

log = logging.getLogger("trainfast")
RECOMPILE_LIMIT = 1  # frames recompiled during the measured compiled steps (guards failing step after step)
GRAPH_BREAK_LIMIT = 8  # each break runs eager code between graphs at every step


# ---------------------------------------------------------------------- precision
@dataclass
class PrecisionAB(AB):
    guard: dict[str, float] = field(default_factory=dict)  # the first batch's loss per precision
    local_gap: float = 0.0  # relative gap of those two losses on this rank's batch (inf: the mixed one not finite)
    guard_gap: float = 0.0  # the largest over all ranks
    out_of_memory: str | None = None  # fp32 ran out of memory on its first batch's probe


class Precision(Practice[PrecisionAB]):
    name = "precision"

    @staticmethod
    def requested_in(config: TrainConfig) -> str:
        return config.precision

    def prior(self, settings: Settings) -> str:
        return settings.precision.name

    def plan(self, settings: Settings, plan: Plan) -> PrecisionAB | Choice:
        policy = settings.precision  # (fp16 on a GPU without bf16: fp32 is no contender for its tensor cores)
        measurable = self.requested == "auto" and policy.autocast_dtype is not None and not policy.needs_scaler
        if measurable and plan.sharded:  # FSDP's parameters are cast once, as the policy it was sharded with says
            return Choice(self.name, self.prior(settings), f"{policy.reason}; not measured under FSDP (its "
                          "MixedPrecisionPolicy is set when the model is sharded)")
        if measurable and plan.affordable:
            return PrecisionAB((self.prior(settings), "32-true"))
        return Choice(self.name, self.prior(settings), f"{policy.reason}; {plan.unmeasured}" if measurable
                      else policy.reason)

    def apply(self, settings: Settings, setting: str) -> None:
        settings.precision = _policy(settings, setting)

    def before_cycle(self, settings: Settings, ab: PrecisionAB, batch: Any, loss_of: LossOf) -> bool:
        if ab.cycle == 0:
            self.loss_guard(settings, ab, batch, loss_of)
        return ab.out_of_memory is not None  # fp32 cannot train here: decided now, on every rank

    def figures(self, ab: PrecisionAB) -> list[float]:
        return [ab.guard_gap, float(ab.out_of_memory is not None)]

    def agreed(self, ab: PrecisionAB, values: list[float]) -> PrecisionAB:
        gap, oom = values
        return replace(ab, guard_gap=gap, out_of_memory=ab.out_of_memory or ("on another rank" if oom > 0 else None))

    def decide(self, settings: Settings, ab: PrecisionAB) -> Choice:
        mixed, fp32 = ab.settings
        losses = {name: ab.guard[name] for name in ab.settings if name in ab.guard}  # as reported: this rank's batch
        if ab.out_of_memory is not None:
            return Choice(self.name, mixed, f"kept {mixed}: fp32 ran out of memory on the first batch "
                                            f"({ab.out_of_memory})", {}, losses)
        medians = median_times(ab)
        verdict = decision(ab, fp32, mixed)  # the mixed precision against fp32
        said, figures = verdict.said(fp32, mixed), f"(median step {in_ms(medians)})"
        if ab.guard_gap > LOSS_TOLERANCE:
            off = "non-finite" if math.isinf(ab.guard_gap) else f"{ab.guard_gap:.1%} off"
            here = ab.local_gap == ab.guard_gap and fp32 in ab.guard
            which = f"fp32: {ab.guard[fp32]:.4g}" if here else "on another rank's batch"
            return Choice(self.name, fp32, f"refused {mixed}: its loss on the first batch is {off} ({which}, "
                                           f"tolerance {LOSS_TOLERANCE:.0%}); {said} {figures}", medians, losses,
                          verdict)
        if verdict.faster:
            return Choice(self.name, mixed, f"{said}, same-batch loss within {LOSS_TOLERANCE:.0%} {figures}",
                          medians, losses, verdict)
        return Choice(self.name, fp32, f"{said}: kept {fp32}, it is exact {figures}", medians, losses, verdict)

    @staticmethod
    def loss_guard(settings: Settings, ab: PrecisionAB, batch: Any, loss_of: LossOf) -> None:
        """The first batch's loss under each precision from the same weights, without a trace (no step, no statistics
        update; unwrapped, so no DDP collective): the mixed one must match fp32's. fp32's is taken with its backward,
        which also shows whether fp32 fits in memory (a batch size chosen under bf16 may not): if not, the prior
        stays."""
        mixed, fp32 = ab.settings
        module, device = settings.module, settings.device
        with torch.no_grad(), untouched(module, device), _policy(settings, mixed).autocast():
            ab.guard[mixed] = float(loss_of(module, batch).float())
        with untouched(module, device):  # from the same random state: the same dropout masks
            try:
                loss = forward_backward(module, batch, loss_of, _policy(settings, fp32).autocast())
                ab.guard[fp32] = float(loss.detach().float())
            except Exception as e:
                if not is_oom(e):
                    raise
                ab.out_of_memory = first_line(e)[:200]
        ab.local_gap = ab.guard_gap = relative_gap(ab.guard.get(mixed), ab.guard.get(fp32))
        if settings.agree([float(ab.out_of_memory is not None)])[0] > 0 and ab.out_of_memory is None:
            ab.out_of_memory = "on another rank"


def _policy(settings: Settings, name: str) -> PrecisionPolicy:
    if name == "32-true":  # the fp32 contender keeps what "auto" decided for TF32 (free on Ampere and newer)
        return replace(resolve_precision("32-true", settings.caps), tf32=settings.precision.tf32,
                       reason="fp32 measured against mixed precision")
    return resolve_precision(name, settings.caps) if name != settings.precision.name else settings.precision


# ---------------------------------------------------------------------- channels_last
class ChannelsLast(Practice[AB]):
    name = "channels_last"

    @staticmethod
    def requested_in(config: TrainConfig) -> bool | str:
        return config.channels_last

    def prior(self, settings: Settings) -> str:
        return "channels_last" if settings.channels_last else "contiguous"

    def plan(self, settings: Settings, plan: Plan) -> AB | Choice:
        prior = self.prior(settings)
        has_conv = any(isinstance(m, nn.Conv2d) for m in settings.module.modules())
        if plan.sharded:  # fully_shard takes contiguous parameters only (torch 2.13); the model was made so
            return Choice(self.name, "contiguous", "FSDP shards contiguous parameters only")
        if self.requested == "auto" and has_conv and plan.affordable and not plan.distributed:
            return AB((prior, "contiguous" if prior == "channels_last" else "channels_last"))
        # (DDP's gradient buckets are views in the parameters' layout: no switching under it)
        return Choice(self.name, prior, "requested" if self.requested != "auto" else "no Conv2d layer"
                      if not has_conv else "not measured under DDP" if plan.distributed else plan.unmeasured)

    def apply(self, settings: Settings, setting: str) -> None:
        """The model in this layout, and the optimizer's moments with it: an element-wise optimizer (AdamW) updates
        the same values in any layout, but a fused kernel walks a moment and its parameter by their strides (CPU's
        silently in the wrong order, CUDA's raises)."""
        fmt = _format(setting)
        settings.channels_last = setting == "channels_last"
        if all(p.is_contiguous(memory_format=fmt) for p in settings.module.parameters() if p.dim() == 4):
            return  # nothing to move (a sharded model's parameters cannot be moved)
        settings.module.to(memory_format=fmt)  # type: ignore[call-overload]
        for param, state in settings.optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() == 4 and value.shape == param.shape:
                    state[key] = value.contiguous(memory_format=fmt)

    def inputs(self, ab: AB, batch: Any) -> Any:
        if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor) and batch[0].dim() == 4:
            return rebuilt(batch, [batch[0].contiguous(memory_format=_format(ab.setting())), *batch[1:]])
        return batch

    def decide(self, settings: Settings, ab: AB) -> Choice:
        prior, alt = ab.settings
        medians = median_times(ab)
        verdict = decision(ab, prior, alt)  # the other layout against the prior
        said, figures = verdict.said(prior, alt), f"(median step {in_ms(medians)})"
        if verdict.faster:
            return Choice(self.name, alt, f"{said} {figures}", medians, decision=verdict)
        return Choice(self.name, prior, f"{said}: kept {prior} {figures}", medians, decision=verdict)


def _format(layout: str) -> torch.memory_format:
    return torch.channels_last if layout == "channels_last" else torch.contiguous_format


# ---------------------------------------------------------------------- compile
@dataclass
class CompileChoice(Choice):
    compile_s: float | None = None
    recompiles: int | None = None
    graph_breaks: int | None = None
    recompiles_after: int | None = None  # frames compiled after a compiled step was chosen (set when fit ends)

    def to_json(self) -> dict[str, Any]:
        return {"chosen": self.chosen, "reason": self.reason, "measured": bool(self.step_s),
                "eager_step_s": self.step_s.get("eager"), "compiled_step_s": self.step_s.get("compiled"),
                "compile_s": self.compile_s, "recompiles": self.recompiles, "graph_breaks": self.graph_breaks,
                "recompiles_after": self.recompiles_after} | self.ab_json()


@dataclass
class CompileAB(AB):
    compile_s: float = 0.0  # the compiling step's time (a normal step's time is taken off at the decision)
    compile_error: str | None = None
    breaks_before: int = 0  # graph breaks counted before compiling
    frames_before: int | None = None  # frames compiled when the measured compiled steps began
    recompiles: int = 0  # agreed at the decision
    breaks: int = 0
    non_finite: bool = False  # a compiled step's loss was not finite (on any rank)


class Compile(Practice[CompileAB]):
    name = "compile"

    def __init__(self, config: TrainConfig) -> None:
        super().__init__(config)
        self.compiled: nn.Module | None = None
        self.frames_at_choice: int | None = None

    @staticmethod
    def requested_in(config: TrainConfig) -> bool | str:
        return config.compile

    def prior(self, settings: Settings) -> str:
        return "eager"

    def choice(self, chosen: str, reason: str) -> CompileChoice:
        return CompileChoice(self.name, chosen, reason)

    def plan(self, settings: Settings, plan: Plan) -> CompileAB | Choice:
        if self.requested is False:
            return self.choice("eager", "compile=False")
        if plan.fresh and plan.steps >= (plan.queued + 1) * MAX_STEPS:  # the A/Bs before it and its own, at most
            return CompileAB((self.prior(settings), "compiled"))
        if self.requested is True:
            return self.choice("compiled", "compile=True; not measured: run too short or resumed")
        return self.choice("eager", f"not measured: run of {plan.steps} steps is too short to time a compiled step"
                           if plan.fresh else plan.unmeasured)

    def apply(self, settings: Settings, setting: str) -> None:
        settings.model = self.compiled if setting == "compiled" and self.compiled is not None else settings.eager

    def before_cycle(self, settings: Settings, ab: CompileAB, batch: Any, loss_of: LossOf) -> bool:
        if ab.cycle == 1:
            self.compile_step(settings, ab, batch, loss_of)
        return ab.compile_error is not None  # nothing compiled to time: decided now, this step is eager

    def after_cycle(self, ab: CompileAB) -> None:
        if ab.cycle == FIRST_TIMED:
            ab.frames_before = dynamo_counts()["frames"]  # recompiles count from the measured compiled steps on

    def figures(self, ab: CompileAB) -> list[float]:
        counts = dynamo_counts()
        recompiles = counts["frames"] - ab.frames_before if ab.frames_before is not None else 0
        return [float(ab.compile_error is not None), float(not all(math.isfinite(x) for x in ab.losses)),
                float(recompiles), float(counts["graph_breaks"] - ab.breaks_before), ab.compile_s]

    def agreed(self, ab: CompileAB, values: list[float]) -> CompileAB:
        failed, non_finite, recompiles, breaks, compile_s = values
        return replace(ab, compile_s=compile_s, recompiles=int(recompiles), breaks=int(breaks),
                       non_finite=non_finite > 0,
                       compile_error=ab.compile_error or ("compilation failed on another rank" if failed > 0 else None))

    def decide(self, settings: Settings, ab: CompileAB) -> Choice:
        medians = median_times(ab)
        if "eager" not in medians and settings.settled_step_s is not None:  # a failed compile ended the A/B early
            medians = {"eager": settings.settled_step_s, **medians}
        eager, compiled = medians.get("eager", math.nan), medians.get("compiled", math.nan)
        compile_s = max(0.0, ab.compile_s - eager) if math.isfinite(eager) else ab.compile_s  # less one step's time
        done = CompileChoice(self.name, "eager", "", medians, compile_s=compile_s, recompiles=ab.recompiles,
                             graph_breaks=ab.breaks)
        if ab.compile_error is not None:
            return replace(done, reason=f"compilation failed after {compile_s:.1f} s: {ab.compile_error}")
        verdict = decision(ab, "eager", "compiled")  # the compiled step against eager
        done = replace(done, decision=verdict)
        figures = (f"median step eager {eager * 1e3:.1f} ms vs compiled {compiled * 1e3:.1f} ms, compile "
                   f"{compile_s:.1f} s; {ab.recompiles} recompiles, {ab.breaks} graph breaks")
        if self.requested is True:
            return replace(done, chosen="compiled", reason=f"compile=True ({verdict.said('eager', 'compiled')}; "
                                                           f"{figures})")
        if ab.non_finite:
            why = "the compiled steps' loss was not finite"
        elif ab.recompiles > RECOMPILE_LIMIT:
            timed = len(ab.times.get("compiled", []))
            why = f"{ab.recompiles} recompiles over {timed} measured compiled steps (limit {RECOMPILE_LIMIT})"
        elif ab.breaks > GRAPH_BREAK_LIMIT:
            why = f"{ab.breaks} graph breaks (limit {GRAPH_BREAK_LIMIT})"
        elif not verdict.faster:
            why = f"{verdict.said('eager', 'compiled')}: kept eager"
        else:  # the compile time is spent whatever is chosen now: only the steps ahead count
            return replace(done, chosen="compiled", reason=f"{verdict.said('eager', 'compiled')} ({figures})")
        return replace(done, reason=f"{why} ({figures})")

    def settle(self, settings: Settings, choice: Choice) -> None:
        if choice.chosen == "compiled":
            if self.compiled is None:  # (resumed, or compile=True unmeasured: it compiles on its first step)
                self.compiled = cast(nn.Module, torch.compile(settings.eager))
            else:  # compiled by the A/B: any frame compiled from now on is a recompile
                self.frames_at_choice = dynamo_counts()["frames"]
        self.apply(settings, choice.chosen)

    def finish(self, choice: Choice) -> None:
        """Frames compiled after a compiled step was chosen (an eval-mode validation, a last batch of another size)
        are each a compile the A/B did not see; reported in the compile block and logged."""
        if not isinstance(choice, CompileChoice) or choice.chosen != "compiled" or self.frames_at_choice is None:
            return
        choice.recompiles_after = dynamo_counts()["frames"] - self.frames_at_choice
        if choice.recompiles_after:
            log.warning("torch.compile compiled %d more frame(s) after it was chosen (validation in eval mode, a last "
                        "batch of another size: drop_last=True, or torch._dynamo.mark_dynamic on the batch axis)",
                        choice.recompiles_after)

    def compile_step(self, settings: Settings, ab: CompileAB, batch: Any, loss_of: LossOf) -> None:
        """Compile and run one forward and backward on this batch, timed and without a trace (gradients, BatchNorm
        statistics and random streams put back): the compile time, and a compiled step that fails, or gives a loss
        or gradients eager does not, is caught before it can touch the weights. Inductor draws random numbers as
        eager does (`fallback_random`) for the compiled graph, so dropout gives both the same masks from the same
        random state and the loss comparison holds; the outcome is agreed by every rank."""
        module, device, precision = settings.module, settings.device, settings.precision
        ab.breaks_before = dynamo_counts()["graph_breaks"]
        with torch.no_grad(), untouched(module, device), precision.autocast():
            eager_loss = float(loss_of(module, batch).float())
        clock = DeviceClock(device)
        clock.start()
        finite, loss = True, math.nan
        try:
            from torch._inductor import config as inductor_config

            self.compiled = cast(nn.Module, torch.compile(settings.eager))
            with untouched(module, device), inductor_config.patch(fallback_random=True):
                # the Trainer's step, unscaled on purpose: the check is of finite gradients, and fp16's first scaled
                # ones may overflow (the scaler's business, not a compile defect)
                out = forward_backward(self.compiled, batch, loss_of, precision.autocast())
                grads = [p.grad for p in module.parameters() if p.grad is not None]
                finite = all(bool(torch.isfinite(g).all()) for g in grads)
            loss = float(out.detach().float())  # (synchronises)
        except Exception as e:  # any failure to compile means eager, with the reason
            if self.requested is True:
                raise
            first = str(e).splitlines()[0] if str(e) else ""
            ab.compile_error, self.compiled = f"{type(e).__name__}: {first}"[:300], None
        ab.compile_s = clock.elapsed()
        off = loss_gap(loss, eager_loss) if ab.compile_error is None else None
        if ab.compile_error is None and (off is not None or not finite):
            wrong = (f"a loss that is {off} (eager: {eager_loss:.4g}, same batch)" if off is not None
                     else "non-finite gradients where eager's are finite")
            if self.requested is True:
                raise RuntimeError(f"compile=True: the compiled step gives {wrong} (a torch.compile defect for "
                                   f"this model at {precision.name}); use compile='auto' (falls back to eager) "
                                   "or False")
            ab.compile_error, self.compiled = f"the compiled step gave {wrong}", None
        if settings.agree([float(ab.compile_error is not None)])[0] > 0 and ab.compile_error is None:
            ab.compile_error, self.compiled = "compilation failed on another rank", None


# ---------------------------------------------------------------------- the registry
# Each practice's A/B in this order; one more is one more class above and one more entry here.
PRACTICES: tuple[type[Practice[Any]], ...] = (Precision, ChannelsLast, Compile)
