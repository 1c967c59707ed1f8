"""Precision, channels_last and compile chosen by A/Bs on the run's first steps (trainer/practices.py runs the
practices of trainer/practice_kinds.py).

The models here sleep in one setting, so each A/B has a known answer on any CPU; torch.compile is faked where a
test is about the decision rather than inductor, and the A/Bs' clock (`FakeClock`) where a test is about when an A/B
stops. They train on one intra-op thread (`one_intra_op_thread`): on two, with other processes busy on both cores, a
step of these tiny models took ~0.1 s and varied by more than the sleep.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from trainfast.loader.memory import TensorLoader
from trainfast.precision import cpufeatures
from trainfast.trainer import practice_kinds, practices
from trainfast.trainer.config import TrainConfig
from trainfast.trainer.loop import Trainer
from trainfast.trainer.practice import AB, FIRST_TIMED
from trainfast.trainer.practices import MAX_PAIRS, MAX_STEPS, MIN_PAIRS, MIN_RUN_MULTIPLE

DELAY_S = 0.015  # the slow setting's extra time per step: far above a 2-core CPU's step-to-step noise on one thread
# every training forward's floor: the fast setting's step is then not a millisecond that a busy core stretches several
# times over (an A/B decides on pairs that agree; two pairs 1.6x apart need a 2x gap at the first look)
BASE_S = 0.005
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class Sleepy(nn.Module):
    """A conv net that sleeps in each forward where `slow(self, x)` says so; `shift` is added to its first logit under
    autocast (a precision that changes the loss)."""

    def __init__(self, slow: Callable[[Sleepy, torch.Tensor], bool] = lambda m, x: False, shift: float = 0.0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)
        self.slow, self.shift, self.fast = slow, shift, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            time.sleep(BASE_S)
        if self.slow(self, x):
            time.sleep(DELAY_S)
        out: torch.Tensor = self.head(self.conv(x).mean(dim=(2, 3)))
        if self.shift and torch.is_autocast_enabled("cpu"):
            out = out + torch.tensor([self.shift, 0.0])  # favours class 0: the loss changes (a uniform shift would not)
        return out


def fp32_slow(m: Sleepy, x: torch.Tensor) -> bool:
    return not torch.is_autocast_enabled("cpu")


def bf16_slow(m: Sleepy, x: torch.Tensor) -> bool:
    return torch.is_autocast_enabled("cpu")


def nhwc_slow(m: Sleepy, x: torch.Tensor) -> bool:
    return m.conv.weight.is_contiguous(memory_format=torch.channels_last)


def eager_slow(m: Sleepy, x: torch.Tensor) -> bool:
    return not m.fast


def loader(steps: int, batch: int = 8) -> TensorLoader:
    g = torch.Generator().manual_seed(0)
    n = steps * batch
    return TensorLoader((torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 2, (n,), generator=g)), batch,
                        shuffle=False)


@pytest.fixture
def native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """This CPU has native bf16, as far as the precision prior can tell (torch emulates it where it has not)."""
    monkeypatch.setattr(cpufeatures, "cpu_bf16", lambda: "AVX512-BF16")


def fit(model: nn.Module, steps: int = 30, **settings: object) -> dict[str, object]:
    config = TrainConfig(**{"epochs": 1, "progress": False, "device": "cpu", "lr": 1e-3, **settings})  # type: ignore[arg-type]
    return Trainer(model, config=config).fit(loader(steps)).to_json()


class FakeClock:
    """The A/Bs' clock (a `DeviceClock` in `Practices`), faked: each micro-batch takes `seconds(practices)`, from the
    settings as they stand, so an A/B's timings are exact on any CPU, however busy."""

    def __init__(self, practices: practices.Practices, seconds: Callable[[practices.Practices], float]) -> None:
        self.practices, self.seconds = practices, seconds

    def start(self) -> None:
        pass

    def elapsed(self) -> float:
        return self.seconds(self.practices)


def fit_timed(monkeypatch: pytest.MonkeyPatch, seconds: Callable[[practices.Practices], float], steps: int = 30,
              **settings: object) -> dict[str, object]:
    """`fit` with the A/Bs timed by `FakeClock(seconds)`."""
    config = TrainConfig(**{"epochs": 1, "progress": False, "device": "cpu", "lr": 1e-3, **settings})  # type: ignore[arg-type]
    trainer = Trainer(Sleepy(), config=config)
    monkeypatch.setattr(trainer.practices, "_clock", FakeClock(trainer.practices, seconds))
    return trainer.fit(loader(steps)).to_json()


def practice_block(result: dict[str, object], name: str) -> dict[str, object]:
    out = result[name]
    assert isinstance(out, dict)
    return out


@pytest.mark.parametrize(("slow", "chosen"), [(fp32_slow, "bf16-mixed"), (bf16_slow, "32-true")])
def test_precision_ab_keeps_the_faster(native_bf16: None, slow: Callable[[Sleepy, torch.Tensor], bool],
                                       chosen: str) -> None:
    result = fit(Sleepy(slow), channels_last=False)
    precision = result["precision"]
    assert isinstance(precision, dict)
    assert precision["chosen"] == chosen and precision["measured"] is True
    step_s = precision["step_s"]
    assert set(step_s) == {"bf16-mixed", "32-true"}
    loser = "32-true" if chosen == "bf16-mixed" else "bf16-mixed"
    assert step_s[loser] - step_s[chosen] > 0.5 * DELAY_S
    assert set(precision["loss"]) == {"bf16-mixed", "32-true"}
    decision = precision["decision"]
    assert decision["verdict"] == ("faster" if chosen == "bf16-mixed" else "slower")  # bf16 against fp32
    assert precision["pairs"] == decision["pairs"] + decision["set_aside"]  # (a stalled pair is set aside)
    assert precision["steps"] == FIRST_TIMED + 2 * precision["pairs"] <= MAX_STEPS
    assert f", {decision['pairs']} pair" in precision["reason"]  # the pairs it decided on


def precision_decision(fp32_s: float, pairs: int) -> practices.Choice:
    """The precision practice's choice from `pairs` pairs of exact step times: bf16 at 0.100 s, fp32 at `fp32_s`."""
    ab = practice_kinds.PrecisionAB(("bf16-mixed", "32-true"), times={"bf16-mixed": [0.1] * pairs,
                                                                    "32-true": [fp32_s] * pairs},
                                    guard={"bf16-mixed": 2.30, "32-true": 2.31})
    trainer = Trainer(Sleepy(), config=TrainConfig(device="cpu", progress=False))
    return practice_kinds.Precision(trainer.config).decide(trainer.practices, ab)


@pytest.mark.parametrize(("fp32_s", "chosen", "said"), [
    (0.102, "32-true", "cannot tell bf16-mixed from 32-true at 1.03x"),  # 2 %: within the margin, and the noise
    (0.104, "32-true", "cannot tell bf16-mixed from 32-true at 1.03x"),  # 4 %: beyond the margin, within the noise
    (0.130, "bf16-mixed", "bf16-mixed is faster than 32-true: 1.30x"),
    (0.080, "32-true", "bf16-mixed is slower than 32-true: 0.80x")])
def test_a_mixed_precision_is_kept_only_when_told_faster_than_fp32(native_bf16: None, fp32_s: float, chosen: str,
                                                                     said: str) -> None:
    """bf16 at 0.100 s a step over the A/B's budget of pairs: a 2 % or 4 % gain is within what 4 pairs of steps ~5 %
    apart can tell (fp32 kept: it is exact), 1.3x is not."""
    choice = precision_decision(fp32_s, MAX_PAIRS)
    assert choice.chosen == chosen and choice.reason.startswith(said), choice.reason
    assert (chosen == "32-true") is ("kept 32-true" in choice.reason)
    assert choice.step_s == {"bf16-mixed": 0.1, "32-true": fp32_s} and choice.loss == {"bf16-mixed": 2.30,
                                                                                        "32-true": 2.31}
    assert choice.decision is not None and choice.decision.pairs == MAX_PAIRS


def test_a_precision_within_the_margin_says_the_same_and_keeps_fp32(native_bf16: None) -> None:
    """"Same" needs the interval inside 1.03x either way: at the steps' noise prior (~5 %) that takes 9 or more pairs
    even of identical steps, so the Trainer's A/B (at most `MAX_PAIRS`, 4) never reaches it and says it cannot tell;
    the practice's answer to "same" is fp32 all the same, as here from 12 pairs 0.5 % apart."""
    choice = precision_decision(0.0995, 12)
    assert choice.decision is not None and choice.decision.verdict == "same"
    assert choice.chosen == "32-true", choice.reason
    assert choice.reason.startswith("bf16-mixed is within 1.03x of 32-true: 1.00x") and "kept 32-true" in choice.reason
    within_budget = precision_decision(0.0995, MAX_PAIRS).decision
    assert within_budget is not None and within_budget.verdict == "inconclusive"


def test_a_wide_gap_ends_the_ab_at_the_first_look(native_bf16: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 3x slower than bf16: decided after `MIN_PAIRS` timed pairs, 6 steps (the fixed schedule took 8 whatever
    the gap); the run trains on in bf16, and fit's result says how many steps each A/B took."""
    result = fit_timed(monkeypatch, lambda p: 0.03 if p.precision.name == "32-true" else 0.01, channels_last=False)
    precision = practice_block(result, "precision")
    assert precision["chosen"] == "bf16-mixed", precision["reason"]
    assert precision["pairs"] == MIN_PAIRS and precision["steps"] == FIRST_TIMED + 2 * MIN_PAIRS == 6
    assert precision["decision"]["verdict"] == "faster" and precision["decision"]["ratio"] == pytest.approx(3.0)
    assert precision["reason"].startswith("bf16-mixed is faster than 32-true: 3.00x (") and "2 pairs)" in \
        precision["reason"]
    assert precision["step_s"] == {"bf16-mixed": 0.01, "32-true": 0.03}
    assert result["ab_steps"] == {"precision": 6, "channels_last": 0, "compile": 0}
    assert result["steps"] == 30


def test_no_difference_runs_to_the_budget_and_keeps_the_safe_settings(native_bf16: None,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step the same 20 ms: neither A/B can tell its settings apart, so each runs its `MAX_PAIRS` pairs (10
    steps) and keeps the safe setting: fp32 (exact), and the prior layout."""
    result = fit_timed(monkeypatch, lambda p: 0.02)
    precision, layout = practice_block(result, "precision"), practice_block(result, "channels_last")
    assert precision["chosen"] == "32-true" and layout["chosen"] == "channels_last"
    for ab in (precision, layout):
        assert ab["measured"] is True and ab["steps"] == MAX_STEPS == 10 and ab["pairs"] == MAX_PAIRS
        assert ab["decision"]["verdict"] == "inconclusive"
    assert precision["reason"].startswith("cannot tell bf16-mixed from 32-true at 1.03x") and \
        "kept 32-true" in precision["reason"]
    assert layout["reason"].startswith("cannot tell contiguous from channels_last at 1.03x") and \
        "kept channels_last" in layout["reason"]
    assert result["ab_steps"] == {"precision": 10, "channels_last": 10, "compile": 0} and result["steps"] == 30


def test_the_pairs_alternate_their_order_after_the_warm_ups() -> None:
    """Warm-ups prior then alternative, then pairs A B, B A, A B, B A: a drift from step to step favours neither."""
    ab = AB(("a", "b"))
    order = []
    for cycle in range(MAX_STEPS):
        ab.cycle = cycle
        order.append(ab.setting())
    assert "".join(order) == "ab" + "ab" + "ba" + "ab" + "ba"


def test_a_precision_that_changes_the_loss_is_refused_however_fast(native_bf16: None) -> None:
    precision = fit(Sleepy(fp32_slow, shift=3.0), channels_last=False)["precision"]
    assert isinstance(precision, dict)
    assert precision["chosen"] == "32-true"
    assert precision["reason"].startswith("refused bf16-mixed: its loss on the first batch is")
    loss = precision["loss"]
    assert abs(loss["bf16-mixed"] - loss["32-true"]) > practices.LOSS_TOLERANCE * loss["32-true"]


def test_the_loss_guard_leaves_no_trace(native_bf16: None) -> None:
    """The guard's extra forwards neither update BatchNorm statistics nor consume the dropout stream, and each starts
    from the same random state."""
    def build() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5), nn.Flatten(), nn.LazyLinear(2))

    torch.manual_seed(2)
    model = build()
    model(torch.randn(2, 3, 8, 8))  # materialise the lazy layer
    batch = next(iter(loader(1)))
    settings = Trainer(model, config=TrainConfig(device="cpu", progress=False, channels_last=False)).practices
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    guarded = practice_kinds.PrecisionAB(("bf16-mixed", "32-true"))
    practice_kinds.Precision.loss_guard(settings, guarded, batch,
                                        lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))
    assert set(guarded.guard) == {"bf16-mixed", "32-true"} and all(map(math.isfinite, guarded.guard.values()))
    assert guarded.local_gap < 0.02  # both forwards drew the same dropout mask (other masks: 5-10 % apart)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())  # fp32's backward (its memory probe) left nothing
    assert torch.equal(rng, torch.get_rng_state())


def test_a_short_run_keeps_the_prior_and_says_why(native_bf16: None) -> None:
    steps = MIN_RUN_MULTIPLE * MAX_STEPS - 1
    result = fit(Sleepy(bf16_slow), steps=steps)
    precision, layout = result["precision"], result["channels_last"]
    assert isinstance(precision, dict) and isinstance(layout, dict)
    assert precision["chosen"] == "bf16-mixed" and precision["measured"] is False
    assert f"run of {steps} steps" in precision["reason"] and "AVX512-BF16" in precision["reason"]
    assert layout["chosen"] == "channels_last" and layout["measured"] is False


def test_no_native_bf16_means_fp32_and_no_ab(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpufeatures, "cpu_bf16", lambda: None)
    precision = fit(Sleepy(fp32_slow), channels_last=False)["precision"]
    assert isinstance(precision, dict)
    assert precision["chosen"] == "32-true" and precision["measured"] is False
    assert "no native bf16" in precision["reason"]


def test_channels_last_ab_switches_the_model_and_its_optimizer_state() -> None:
    model = Sleepy(nhwc_slow)
    trainer = Trainer(model, config=TrainConfig(epochs=1, progress=False, device="cpu", precision="32-true"))
    result = trainer.fit(loader(30)).to_json()
    layout = result["channels_last"]
    assert isinstance(layout, dict)
    assert layout["chosen"] == "contiguous" and set(layout["step_s"]) == {"channels_last", "contiguous"}
    assert trainer.channels_last is False
    assert model.conv.weight.is_contiguous()
    moments = trainer.optimizer.state[model.conv.weight]
    assert all(v.is_contiguous() for v in moments.values() if v.dim() == 4)


class FakeCompiled(nn.Module):
    """What the faked torch.compile returns: the same model, run "fast" (or failing, or giving NaN)."""

    def __init__(self, inner: Sleepy, mode: str = "fast") -> None:
        super().__init__()
        self.inner, self.mode = inner, mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "fail":
            raise RuntimeError("inductor: no working C++ compiler found")
        self.inner.fast = True
        try:
            out: torch.Tensor = self.inner(x)
        finally:
            self.inner.fast = False
        return out * math.nan if self.mode == "nan" else out


def fake_compile(monkeypatch: pytest.MonkeyPatch, mode: str = "fast") -> None:
    monkeypatch.setattr(torch, "compile", lambda model: FakeCompiled(model, mode))


def compile_block(result: dict[str, object]) -> dict[str, object]:
    block = result["compile"]
    assert isinstance(block, dict)
    assert set(block) >= {"chosen", "eager_step_s", "compiled_step_s", "compile_s", "recompiles", "graph_breaks",
                          "reason"}
    return block


def test_compile_auto_keeps_a_faster_compiled_step(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_compile(monkeypatch)
    block = compile_block(fit(Sleepy(eager_slow), steps=40, precision="32-true", channels_last=False,
                              compile="auto"))
    assert block["chosen"] == "compiled", block["reason"]
    assert block["eager_step_s"] - block["compiled_step_s"] > 0.5 * DELAY_S  # type: ignore[operator]
    assert block["recompiles"] == 0 and block["graph_breaks"] == 0 and block["compile_s"] >= 0  # type: ignore[operator]


def test_a_faster_compiled_step_is_kept_however_long_its_compile_took(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile time is spent by the time the A/B decides, whatever it decides: only the steps ahead count."""
    fake_compile(monkeypatch)
    original = practice_kinds.Compile.compile_step

    def slow_compile(self: practice_kinds.Compile, settings: practices.Practices, ab: practice_kinds.CompileAB,
                     batch: object, loss_of: object) -> None:
        original(self, settings, ab, batch, loss_of)  # type: ignore[arg-type]
        ab.compile_s += 60.0  # as if inductor took a minute: the ~24 steps left at 15 ms saved never repay it

    monkeypatch.setattr(practice_kinds.Compile, "compile_step", slow_compile)
    block = compile_block(fit(Sleepy(eager_slow), steps=MIN_RUN_MULTIPLE * MAX_STEPS, precision="32-true",
                              channels_last=False, compile="auto"))
    assert block["chosen"] == "compiled", block["reason"]
    assert block["compile_s"] > 59  # type: ignore[operator]


def test_compile_auto_falls_back_when_compilation_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_compile(monkeypatch, "fail")
    result = fit(Sleepy(eager_slow), precision="32-true", channels_last=False, compile="auto")
    block = compile_block(result)
    assert block["chosen"] == "eager"
    assert re.match(r"compilation failed after \d+\.\d s: RuntimeError: inductor: no working C\+\+ compiler found",
                    str(block["reason"]))
    assert block["compiled_step_s"] is None  # nothing compiled was timed: the A/B ended at the failure
    assert result["steps"] == 30  # the failure cost no step


def test_compile_true_raises_when_compilation_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_compile(monkeypatch, "fail")
    with pytest.raises(RuntimeError, match="no working C"):
        fit(Sleepy(), precision="32-true", channels_last=False, compile=True)


def test_a_compiled_step_that_gives_nan_never_touches_the_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_compile(monkeypatch, "nan")
    result = fit(Sleepy(eager_slow), precision="32-true", channels_last=False, compile="auto")
    block = compile_block(result)
    assert block["chosen"] == "eager"
    assert "the compiled step gave a loss that is non-finite" in str(block["reason"])
    assert math.isfinite(result["final_loss"])  # type: ignore[arg-type]


@pytest.mark.parametrize(("frames", "breaks", "why"), [(5, 0, "recompiles over"), (0, 10, "graph breaks (limit")])
def test_compile_auto_falls_back_on_recompiles_or_graph_breaks(monkeypatch: pytest.MonkeyPatch, frames: int,
                                                                breaks: int, why: str) -> None:
    fake_compile(monkeypatch)
    counts = {"frames": 0, "graph_breaks": 0}

    def growing() -> dict[str, int]:  # each read finds more: dynamo recompiling, or breaking graphs, all along
        counts["frames"] += frames
        counts["graph_breaks"] += breaks
        return dict(counts)

    monkeypatch.setattr(practice_kinds, "dynamo_counts", growing)
    block = compile_block(fit(Sleepy(eager_slow), precision="32-true", channels_last=False, compile="auto"))
    assert block["chosen"] == "eager"
    assert why in str(block["reason"])


def test_compile_true_reports_the_figures_and_keeps_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_compile(monkeypatch)
    block = compile_block(fit(Sleepy(lambda m, x: m.fast), precision="32-true", channels_last=False, compile=True))
    assert block["chosen"] == "compiled"  # even though it is the slower here
    assert block["compiled_step_s"] > block["eager_step_s"]  # type: ignore[operator]


def test_compile_false_reports_eager() -> None:
    block = compile_block(fit(Sleepy(), precision="32-true", channels_last=False))
    assert block["chosen"] == "eager" and block["reason"] == "compile=False" and block["eager_step_s"] is None


def test_a_resumed_run_trains_with_what_its_start_chose(native_bf16: None, tmp_path: Path) -> None:
    model = Sleepy(bf16_slow)
    config = TrainConfig(epochs=2, progress=False, device="cpu", channels_last=False, checkpoint_dir=str(tmp_path))
    first = Trainer(model, config=TrainConfig.from_dict({**config.to_dict(), "epochs": 1})).fit(loader(30))
    assert first.precision is not None and first.precision["chosen"] == "32-true"  # measured: bf16 is slow here
    state = torch.load(tmp_path / "last.pt", weights_only=True)
    assert state["practices"]["precision"] == "32-true"
    resumed = Trainer(Sleepy(), config=config).fit(loader(30), resume=True)
    assert resumed.precision is not None
    assert resumed.precision["chosen"] == "32-true" and "kept on resume" in resumed.precision["reason"]


def test_every_rank_decides_on_the_slowest_rank_s_step_times(native_bf16: None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank times its own steps; all decide on the agreed figures (each the max over ranks), pair by pair. Here
    this rank's steps all take 20 ms (alone, it would run to its budget, unable to tell), and another rank's bf16
    steps are faked as 0.1 s slower: every rank sees bf16 5x slower in the agreed pairs, ends the A/B at the first
    look and keeps fp32."""
    trainer = Trainer(Sleepy(), config=TrainConfig(epochs=1, progress=False, device="cpu", channels_last=False))
    monkeypatch.setattr(trainer.practices, "_clock", FakeClock(trainer.practices, lambda p: 0.02))
    calls: list[int] = []

    def other_rank_slower_in_bf16(values: list[float], device: torch.device) -> list[float]:
        calls.append(len(values))
        if len(values) != 4:  # the plan's length and the loss guard's flag: one value each
            return values
        bf16, fp32, gap, oom = values  # a pair (the prior's time first) and the practice's figures
        return [bf16 + 0.1, fp32, gap, oom]

    monkeypatch.setattr("trainfast.trainer.loop.all_max", other_rank_slower_in_bf16)
    result = trainer.fit(loader(30))
    assert result.precision is not None and result.precision["chosen"] == "32-true", result.precision
    assert result.precision["steps"] == FIRST_TIMED + 2 * MIN_PAIRS and result.ab_steps["precision"] == 6
    assert result.precision["step_s"] == {"bf16-mixed": pytest.approx(0.12), "32-true": pytest.approx(0.02)}
    assert trainer.precision.name == "32-true"
    assert calls == [1, 1, *[4] * MIN_PAIRS]  # the plan's length, the guard, one collective per timed pair


def test_a_failed_compile_reports_the_eager_step_its_preceding_ab_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_compile(monkeypatch, "fail")
    result = fit(Sleepy(nhwc_slow), precision="32-true", channels_last="auto", compile="auto")
    layout, block = result["channels_last"], compile_block(result)
    assert isinstance(layout, dict) and layout["chosen"] == "contiguous"
    assert block["chosen"] == "eager" and block["compiled_step_s"] is None
    assert block["eager_step_s"] == layout["step_s"]["contiguous"]


class Fp32TooBig(Sleepy):
    """Runs out of memory when it trains in fp32 (as a batch size chosen under bf16 can on a GPU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (faked)")
        return super().forward(x)


def test_a_contender_that_runs_out_of_memory_leaves_the_prior(native_bf16: None) -> None:
    result = fit(Fp32TooBig(), channels_last=False)
    precision = result["precision"]
    assert isinstance(precision, dict)
    assert precision["chosen"] == "bf16-mixed", precision["reason"]
    assert "fp32 ran out of memory on the first batch (CUDA out of memory. Tried to allocate 2.00 GiB" in \
        precision["reason"]
    assert result["steps"] == 30 and math.isfinite(result["final_loss"])  # type: ignore[arg-type]


def test_frames_compiled_after_the_choice_are_reported(monkeypatch: pytest.MonkeyPatch,
                                                       trainfast_log: pytest.LogCaptureFixture) -> None:
    """Validation in eval mode makes dynamo compile the model again, after the A/B chose the compiled step: the
    compile block and a warning say so (here the fake compiled model counts a frame at its first eval forward)."""
    fake_compile(monkeypatch)
    counts = {"frames": 0, "graph_breaks": 0}
    monkeypatch.setattr(practice_kinds, "dynamo_counts", lambda: dict(counts))

    class EvalRecompiles(Sleepy):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self.training and self.fast and counts["frames"] == 0:
                counts["frames"] += 1
            return super().forward(x)

    config = TrainConfig(epochs=1, progress=False, device="cpu", precision="32-true", channels_last=False,
                         compile="auto")
    result = Trainer(EvalRecompiles(eager_slow), config=config).fit(loader(30), loader(2)).to_json()
    block = compile_block(result)
    assert block["chosen"] == "compiled" and block["recompiles_after"] == 1
    assert any("compiled 1 more frame(s) after it was chosen" in r.getMessage() for r in trainfast_log.records)


@pytest.mark.torch_compile
def test_dropout_does_not_trip_the_compiled_loss_guard() -> None:
    """Inductor draws its own random numbers unless told to draw them as eager does: the same batch from the same
    random state then gave another dropout mask, and a loss 6-27 % off eager's (a false "wrong result")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4)  # large weights: the loss depends strongly on the mask
    trainer = Trainer(model, config=TrainConfig(device="cpu", progress=False, precision="32-true", compile="auto"))
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    errors = []
    try:
        for seed in range(3):  # (the first compiles; the others reuse its code)
            torch.manual_seed(seed)
            ab = practice_kinds.CompileAB(("eager", "compiled"))
            practice_kinds.Compile(trainer.config).compile_step(
                trainer.practices, ab, batch, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))
            errors.append(ab.compile_error)
    finally:
        torch._dynamo.reset()
    assert errors == [None] * 3


def test_inputs_follow_a_layout_decided_within_the_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The epoch starts in channels_last (the prior), so its inputs are converted to it; once the A/B settles on
    contiguous (here by decree), the rest of the epoch's inputs must come contiguous too, or the convolutions would
    keep running in channels_last with a contiguous model."""
    monkeypatch.setattr(practice_kinds.ChannelsLast, "decide",
                        lambda self, settings, ab: practices.Choice("channels_last", "contiguous", "decreed"))
    seen: list[bool] = []

    class Records(Sleepy):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.training and torch.is_grad_enabled():
                seen.append(x.is_contiguous())
            return super().forward(x)

    config = TrainConfig(epochs=1, progress=False, device="cpu", precision="32-true", channels_last="auto")
    trainer = Trainer(Records(), config=config)
    steps = trainer.fit(loader(30)).ab_steps["channels_last"]
    assert trainer.channels_last is False and len(seen) == 30
    assert 0 < steps <= MAX_STEPS and not all(seen[:steps]) and all(seen[steps:]), (steps, seen)
