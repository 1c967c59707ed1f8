"""Measured gains: each candidate fix timed on the script's own model and its own training input.

When the measured steps end (a hook, while the script is alive), each model the script trains is copied (its state
must not change: a forward in training mode moves BatchNorm's statistics, a backward fills gradients) and its
forward + backward on its first training input (detached: a GAN's discriminator saw the generator's output), with
the gradient of the outputs' mean as a stand-in for the script's loss, is timed, all models in turn, as they ran
("base") and with each candidate: bf16/fp16 autocast, or float32 where the script autocasts (its own choice is a
candidate too: emulated bf16 runs several times slower than fp32), channels_last, or NCHW where the script trains in
channels_last, another intra-op thread count. Base and candidate alternate, `ROUNDS` times after a warm-up each
(oneDNN builds its bf16 and NHWC kernels on the first call), and the factor is the median of the rounds' base /
candidate ratios, with their spread. Rounds stop as soon as the one decision (`trainfast.decide`, each round a pair)
can tell, from `MIN_ROUNDS` on; a candidate is `faster` only when decided faster: at least 3 % with its interval
clear of no gain (a 3 % edge on this shared 2-core machine is within the noise of a single pair).

What a replay covers: one forward and backward of each model; the loss, the optimizer step and anything else the
step does are not in it. Where the replay is shorter than the step's measured compute, the factor applies only to
the part it covers (`Trial.gain`). Nothing here is a collective: under torchrun every rank replays its own copy, and
a slower one only delays its peers' next all-reduce.

A candidate is not tried where it cannot apply (autocast leaves float64 alone; channels_last without a 2-D
convolution) or where the budget left cannot hold its rounds; the reason is kept, and its recommendation, if any,
is labelled an estimate. Each candidate stands alone: one whose preparation or replay fails is kept with the error
and the doctor's step that failed (`failed`), and the others still run.

A model that cannot be copied (a wrapper holding a lock, a hook or a process group) is replayed in place when no
process group is up: its gradients are put aside and its buffers (BatchNorm's statistics) and parameters' data
restored after every candidate. Under a process group it is not probed (a replay in place would issue collectives
the other ranks are not in), and the reason says so.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from trainfast.decide import looks_between
from trainfast.diagnose.capture.inject_model import to_layout
from trainfast.diagnose.records.trials import Trial, TrialRequest, Trials
from trainfast.trainer.settings import torch_settings

ROUNDS, MIN_ROUNDS, WARMUP_CALLS = 7, 3, 2


# Of the doctor's budget left when the measured steps end, the share the trials may take, and a ceiling: the
# report should not wait a minute for trials on a slow model.
BUDGET_SHARE, MAX_PROBE_S = 0.5, 30.0


@dataclass(frozen=True)
class Candidate:
    id: str
    setting: str
    value: Any
    # a context for the candidate's calls, and a function giving its (model, args, kwargs) from the base's
    context: Callable[[], contextlib.AbstractContextManager[Any]]
    prepare: Callable[[Part, bool], Part] | None = None  # (part, whether to copy the model first)
    # around a whole call, outside its timing: a thread count (set_num_threads is not the step's own time)
    setup: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext

    @property
    def key(self) -> str:
        return f"threads:{self.value}" if self.id == "threads" else self.id


def unwrap(module: nn.Module) -> nn.Module:
    """The model inside a wrapper that a copy cannot or should not take: DistributedDataParallel's and
    DataParallel's `.module` (a process group is not copyable), torch.compile's `_orig_mod` (a copy would compile
    again), Fabric's `_forward_module`."""
    for _ in range(4):
        inner = next((getattr(module, name) for name in ("_orig_mod", "_forward_module", "module")
                      if isinstance(getattr(module, name, None), nn.Module)), None)
        if inner is None:
            return module
        module = inner
    return module


def _outputs_mean(out: Any) -> torch.Tensor | None:
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not leaves:
        return None
    return torch.stack([t.float().mean() for t in leaves]).sum()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Part = tuple[nn.Module, Any]  # a model and its inputs, (args, kwargs)


class _Replay:
    """forward + backward of each model on its inputs, timed; gradients dropped after each call."""

    def __init__(self, parts: list[Part], device: torch.device,
                 context: Callable[[], contextlib.AbstractContextManager[Any]],
                 setup: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext) -> None:
        self.parts, self.device, self.context, self.setup = parts, device, context, setup
        self.params = [p for model, _ in parts for p in model.parameters() if p.requires_grad]

    def __call__(self) -> float:
        with self.setup():
            _synchronize(self.device)
            started = time.perf_counter()
            for model, (args, kwargs) in self.parts:
                with self.context():
                    loss = _outputs_mean(model(*args, **kwargs))
                if loss is None:
                    raise _CannotReplay(f"{type(model).__name__}'s output has no floating tensor that requires a "
                                        "gradient")
                loss.backward()
            _synchronize(self.device)
            elapsed = time.perf_counter() - started
        for p in self.params:
            p.grad = None
        return elapsed


class _CannotReplay(Exception):
    pass


def _in_layout(layout: torch.memory_format, part: Part, copied: bool = True) -> Part:
    """The part in `layout` (NHWC or NCHW): the 4-D parameters and buffers of a copy of the model (of the model itself
    when it is replayed in place: `_kept` puts them back), converted tensor by tensor, not through the model's
    `.to()`, which a wrapper may define otherwise (or refuse), and its 4-D inputs."""
    model, inputs = part
    if copied:
        model = copy.deepcopy(model)
    to_layout(model, layout)
    return model, tree_map(lambda t: t.contiguous(memory_format=layout)
                           if isinstance(t, torch.Tensor) and t.dim() == 4 else t, inputs)


def _twin(model: nn.Module) -> nn.Module:
    """A copy of the model to replay. A `forward` set on the instance (a library's wrapper of it) may close over the
    original model, which the replay must not touch: the copy uses its class's forward unless its own is bound to
    the copy (the script's autocast, which such wrappers add, is the replay's base context anyway)."""
    twin = copy.deepcopy(model)
    forward = vars(twin).get("forward")
    if forward is not None and getattr(forward, "__self__", None) is not twin:
        del twin.forward
    twin.train(model.training)
    return twin


class _Restore:
    """A model replayed in place: its gradients put aside while the probe runs, its buffers (BatchNorm's running
    statistics) put back after each candidate, and the gradients at the end. (A candidate's layout is undone around
    each of its calls: `_kept`.)"""

    def __init__(self, models: list[nn.Module]) -> None:
        self.params = [p for m in models for p in m.parameters()]
        self.grads = [p.grad for p in self.params]
        self.buffers = [(b, b.detach().clone()) for m in models for b in m.buffers()]
        for p in self.params:
            p.grad = None

    def state(self) -> None:
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)

    def close(self) -> None:
        self.state()
        for p, grad in zip(self.params, self.grads, strict=True):
            p.grad = grad


def candidates(requests: Iterable[TrialRequest], *, device: torch.device, autocast: tuple[tuple[str, str], ...],
               threads: int) -> tuple[list[Candidate], dict[str, Trial]]:
    """The candidates the fixes asked for (fixes/rule.py `trials_wanted`), each once, in the order they are timed
    (a precision, a layout, then thread counts, fewest first), and the trials that cannot apply (with why). The base
    of each is the script's own autocast. A thread count is a candidate on the CPU only, and not the script's own
    (`threads`, now)."""
    tried: list[Candidate] = []
    skipped: dict[str, Trial] = {}
    base_context = _script_autocast(device, autocast)
    unique = {r.key: r for r in requests}.values()
    for r in sorted(unique, key=lambda r: (_ORDER.get(r.id, len(_ORDER)), r.value if r.id == "threads" else 0)):
        if r.skip is not None:
            skipped[r.key] = Trial(r.id, r.setting, applies=False, reason=r.skip)
        elif r.id == "fp32":
            tried.append(Candidate("fp32", r.setting, "float32",
                                   functools.partial(torch.autocast, device.type, enabled=False)))
        elif r.id == "amp":
            tried.append(Candidate("amp", r.setting, r.value,
                                   functools.partial(torch.autocast, device.type, dtype=getattr(torch, str(r.value)))))
        elif r.id in ("channels_last", "contiguous"):
            layout = torch.channels_last if r.id == "channels_last" else torch.contiguous_format
            tried.append(Candidate(r.id, r.setting, True, base_context, functools.partial(_in_layout, layout)))
        elif r.id == "threads" and device.type == "cpu" and isinstance(r.value, int) and r.value >= 1 \
                and r.value != threads:
            tried.append(Candidate("threads", r.setting, r.value, base_context,
                                   setup=functools.partial(torch_settings, cpu_threads=r.value)))
    return tried, skipped


_ORDER = {"fp32": 0, "amp": 0, "channels_last": 1, "contiguous": 1, "threads": 2}


def _script_autocast(device: torch.device, autocast: tuple[tuple[str, str], ...]
                     ) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """The autocast the script trains under (its base): the replay must run in the script's precision."""
    for kind, dtype in autocast:
        if kind == device.type:
            return lambda: torch.autocast(device.type, dtype=getattr(torch, dtype))
    return contextlib.nullcontext


def _detached(inputs: Any) -> Any:
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, inputs)


def run_trials(calls: list[tuple[nn.Module, Any]], tried: list[Candidate], *,
               base_autocast: tuple[tuple[str, str], ...], budget_s: float, replays: float = 1.0,
               clock: Callable[[], float] = time.perf_counter) -> Trials:
    """Copy each model of `calls` ((model, (args, kwargs)) of its last training forward), then time each candidate
    against the base within `budget_s` (module doc). `replays`: forward + backward passes of the models per step."""
    started = clock()
    models: dict[int, Part] = {}
    for module, inputs in calls:  # a model reached through two wrappers is one
        model = unwrap(module)
        models[id(model)] = (model, inputs)
    out = Trials(model=", ".join(type(m).__name__ for m, _ in models.values()))
    params = [p for m, _ in models.values() for p in m.parameters()]
    if not params:
        out.reason = "the model has no parameters"
        return out
    device = params[0].device
    try:
        parts = [(_twin(model), _detached(inputs)) for model, inputs in models.values()]
    except Exception as e:  # a module holding something a copy cannot take (a file, a lock, a process group)
        name = next(type(m).__name__ for m, _ in models.values())
        why = f"{name} could not be copied ({type(e).__name__}: {_first_line(e)})"
        if _distributed():
            out.reason = (f"{why}, and a replay in place would issue the model's collectives, which the job's other "
                          "ranks are not in: no candidate was replayed")
            return out
        out.in_place, parts = True, [(model, _detached(inputs)) for model, inputs in models.values()]
    restore = _Restore([m for m, _ in parts]) if out.in_place else None
    base = _Replay(parts, device, _script_autocast(device, base_autocast))
    try:
        base_s = statistics.median(base() for _ in range(WARMUP_CALLS + 1))
        for candidate in tried:
            left = budget_s - (clock() - started)
            trial = _trial(candidate, base, base_s, left, copied=restore is None)
            out.trials[candidate.key] = dataclasses.replace(trial, replays=replays)
            if restore is not None:
                restore.state()
    except _CannotReplay as e:
        out.reason = str(e)
    except Exception as e:  # an OOM, an op the model cannot run outside the script's loop
        out.reason = f"the doctor's replay of the model as the script ran it failed ({type(e).__name__}: " \
                     f"{_first_line(e)})"
    finally:
        if restore is not None:
            restore.close()
    out.seconds = clock() - started
    return out


@contextlib.contextmanager
def _kept(parts: list[Part]) -> Iterator[None]:
    """The models' parameters and buffers as they were on entry, put back on exit: a candidate that changes models
    replayed in place (their tensors' data replaced: a layout) leaves them unchanged."""
    saved = [(t, t.data) for model, _ in parts for t in [*model.parameters(), *model.buffers()]]
    try:
        yield
    finally:
        for t, data in saved:
            t.data = data


@contextlib.contextmanager
def _changed_in_place(candidate: Candidate, parts: list[Part]) -> Iterator[None]:
    """Around one call of a candidate that changes the models, replayed in place: changed, then put back."""
    assert candidate.prepare is not None
    with _kept(parts), candidate.setup():
        for part in parts:
            candidate.prepare(part, False)
        yield


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [""])[0][:200]


def _distributed() -> bool:
    """A process group is up: a model replayed in place may issue collectives (FSDP2's all-gathers) or mark DDP's
    buckets ready, even alone in its group."""
    return bool(torch.distributed.is_available() and torch.distributed.is_initialized())


def _trial(candidate: Candidate, base: _Replay, base_s: float, budget_s: float, *, copied: bool = True) -> Trial:
    # the candidate's own copies of the models, when it changes them (channels_last); models replayed in place are
    # changed around each of the candidate's calls and put back, so the base's calls between run them as they were
    setup, parts = candidate.setup, base.parts
    try:
        if candidate.prepare is not None:
            # (in place, the candidate's inputs stay changed; its models are changed around each call)
            with contextlib.nullcontext() if copied else _kept(base.parts):
                parts = [candidate.prepare(part, copied) for part in base.parts]
            if not copied:
                setup = functools.partial(_changed_in_place, candidate, base.parts)
    except Exception as e:  # (a candidate's failure is its own: the others still run)
        return Trial(candidate.id, candidate.setting, value=candidate.value, failed=True,
                     reason=f"the doctor's {candidate.setting} conversion of the model failed ({type(e).__name__}: "
                            f"{_first_line(e)})")
    cand = _Replay(parts, base.device, candidate.context, setup)
    try:
        first = [cand() for _ in range(WARMUP_CALLS)]
    except Exception as e:
        return Trial(candidate.id, candidate.setting, value=candidate.value, failed=True,
                     reason=f"the doctor's replay of the model under {candidate.setting} failed ({type(e).__name__}: "
                            f"{_first_line(e)})")
    per_round = base_s + min(first)
    rounds = min(ROUNDS, int(max(0.0, budget_s - sum(first)) / per_round)) if per_round > 0 else ROUNDS
    if rounds < MIN_ROUNDS:
        return Trial(candidate.id, candidate.setting, value=candidate.value,
                     reason=f"{MIN_ROUNDS} rounds of a {per_round * 1e3:.0f} ms replay pair did not fit the "
                            f"{max(0.0, budget_s):.1f} s left of the doctor's budget")
    ratios, bases = [], []
    looks = looks_between(MIN_ROUNDS, rounds)
    for _ in range(rounds):
        b = base()
        ratios.append(b / cand())
        bases.append(b)
        trial = Trial.of_rounds(candidate.id, candidate.setting, ratios, bases, candidate.value, looks=looks)
        if len(ratios) >= MIN_ROUNDS and trial.decision is not None and trial.decision.decided:
            break  # decided: the rest of the budget goes to the next candidate
    return trial
