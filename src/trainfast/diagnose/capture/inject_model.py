"""The model fixes `apply_overrides` injects (capture/inject.py) into an unmodified script: the trained model's memory
layout, bf16 autocast around its training forwards, `torch.compile` of it, and its evaluation forwards under
inference_mode + autocast.

"The model" is the one the script trains: the first module called with gradients on, in training mode, that has
parameters requiring them (a frozen teacher, an EMA copy or a transform has none; an evaluation before training runs
with gradients off). It is found by wrapping `nn.Module.__call__` until that first call, and only until then (a
wrapped call costs ~0.3 us for every submodule); from then on its class's `__call__` is wrapped instead, which only
the model's class pays, and only an identity check for its other instances. Everything is put back on exit.

The first call is the found one: the fixes apply to it too (the layout converted before it, the autocast and the
compile around it), so a fixed run differs from the script's from its first forward on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import ExitStack, nullcontext
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_map

# Compiled calls whose floating outputs are checked for inf/NaN against eager (a sync each: only the first few)
CHECKED_CALLS = 3


def _dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class Injected:
    """What happened to the fixes while `apply_overrides` (capture/inject.py) was active, in words (`events`): the
    model it found, a compile that fell back to eager and why; `model` the trained model's class name, once found.
    Read it after the script ran."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.model: str | None = None
        self.fell_back: str | None = None  # why torch.compile fell back to eager, where it did


def to_layout(model: nn.Module, layout: torch.memory_format) -> int:
    """The model's 4-D parameters and buffers in `layout` (NHWC or NCHW), in place and tensor by tensor, not through
    the model's `.to()`, which a wrapper may define otherwise (or refuse, as timm's task wrappers do): the optimizer's
    parameters stay the same objects. Returns how many it converted."""
    converted = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.dim() == 4:
            t.data = t.data.contiguous(memory_format=layout)
            converted += 1
    return converted


def inputs_in_layout(inputs: Any, layout: torch.memory_format) -> Any:
    """The 4-D floating tensors in a call's arguments in `layout` (the images of a conv net)."""
    def convert(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() == 4 and x.is_floating_point():
            return x.contiguous(memory_format=layout)
        return x
    return tree_map(convert, inputs)


def _moments_in_layout(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """An optimizer's state in its parameters' layout before its step: a fused kernel walks a moment and its
    parameter by their strides (CPU's silently in the wrong order, CUDA's raises), and a resumed run loaded its
    moments in the layout they were saved in."""
    for param, state in optimizer.state.items():
        if not isinstance(param, torch.Tensor) or param.dim() != 4:
            continue
        layout = torch.channels_last if param.is_contiguous(memory_format=torch.channels_last) and \
            not param.is_contiguous() else torch.contiguous_format
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape and \
                    not value.is_contiguous(memory_format=layout):
                state[key] = value.contiguous(memory_format=layout)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _float32(out: Any) -> Any:
    """An autocast forward's reduced-precision outputs back in float32: the script's loss and metrics then run as
    they did without the fix (as accelerate's `convert_outputs_to_fp32` does)."""
    return tree_map(lambda x: x.float() if isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float16)
                    else x, out)


def _outside_inference(out: Any) -> Any:
    """An evaluation forward's outputs made outside inference_mode: a script that later uses them where autograd
    saves its inputs (a rollout's values as targets) would fail on inference tensors."""
    return tree_map(lambda x: (x.float() if x.dtype in (torch.bfloat16, torch.float16) else x.clone())
                    if isinstance(x, torch.Tensor) else x, out)


def _finite(out: Any) -> bool:
    return all(bool(torch.isfinite(x).all()) for x in torch.utils._pytree.tree_leaves(out)
               if isinstance(x, torch.Tensor) and x.is_floating_point())


def _trains(module: nn.Module) -> bool:
    return (torch.is_grad_enabled() and module.training and not isinstance(module, torch.jit.ScriptModule)
            and any(p.requires_grad for p in module.parameters()))


class ModelFixes:
    """The model fixes of one `apply_overrides` (`install` into its ExitStack); what happened is said in `injected`
    (the model found, a compile that fell back to eager)."""

    def __init__(self, overrides: Mapping[str, Any], injected: Injected) -> None:
        layout = overrides.get("memory_format")
        self.memory_format = None if layout is None else (
            torch.channels_last if layout == "channels_last" else torch.contiguous_format)
        self.layout = layout
        autocast = overrides.get("autocast")
        self.train_dtype = _dtype(autocast) if isinstance(autocast, str) else None
        self.compile = bool(overrides.get("compile"))
        eval_autocast = overrides.get("eval_autocast")
        self.eval_dtype = _dtype(eval_autocast) if eval_autocast else None
        self.injected = injected
        self.events = injected.events
        self.model: nn.Module | None = None
        self.device_type = "cpu"
        self._compiled = False  # the model's compile is in use (False again after a fall-back)
        self._checked = 0

    @property
    def wanted(self) -> bool:
        return any((self.memory_format is not None, self.train_dtype is not None, self.compile,
                    self.eval_dtype is not None))

    def install(self, stack: ExitStack) -> None:
        if not self.wanted:
            return
        stack.enter_context(_ModelFinder(self, stack))

    def found(self, module: nn.Module, stack: ExitStack) -> None:
        """The model's first training call: convert it, and wrap its class's `__call__` for the calls after."""
        self.model = module
        self.injected.model = type(module).__name__
        param = next(module.parameters())
        self.device_type = param.device.type
        done = []
        if self.memory_format is not None:
            converted = to_layout(module, self.memory_format)
            hook = register_optimizer_step_pre_hook(_moments_in_layout)
            stack.callback(hook.remove)
            done.append(f"{self.layout} ({converted} 4-D weight(s) and the 4-D inputs)")
        if self.train_dtype is not None:
            done.append(f"{_name(self.train_dtype)} autocast around its training forwards")
        if self.compile:
            self._compile(module)
            stack.callback(self._uncompile)
            done.append("torch.compile")
        if self.eval_dtype is not None:
            done.append(f"inference_mode + {_name(self.eval_dtype)} autocast around its evaluation forwards")
        parameters = sum(p.numel() for p in module.parameters())
        self.events.append(f"the model trained ({type(module).__name__}, {parameters:,} parameters, on "
                           f"{self.device_type}): {'; '.join(done)}")
        cls = type(module)
        original = cls.__call__
        fixes = self

        def call(mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if mod is not fixes.model:
                return original(mod, *args, **kwargs)
            return fixes.forward(lambda *a, **k: original(mod, *a, **k), args, kwargs)
        stack.callback(_put_back(cls, "__call__", call))
        cls.__call__ = call  # type: ignore[method-assign]

    def forward(self, call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One call of the model, with the fixes."""
        if self.memory_format is not None:
            args, kwargs = inputs_in_layout((args, kwargs), self.memory_format)
        if not torch.is_grad_enabled():  # an evaluation (or a rollout) forward
            if self.eval_dtype is None:
                return call(*args, **kwargs)
            with torch.inference_mode(), torch.autocast(self.device_type, dtype=self.eval_dtype):
                out = call(*args, **kwargs)
            return _outside_inference(out)
        autocast = (torch.autocast(self.device_type, dtype=self.train_dtype) if self.train_dtype is not None
                    else nullcontext())
        with autocast:
            out = self._guarded(call, args, kwargs) if self._compiled else call(*args, **kwargs)
        return _float32(out) if self.train_dtype is not None else out

    def _guarded(self, call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A compiled call with the guard rails: a compile that fails, or whose first outputs are not finite where
        eager's are, falls back to eager (said in `events`); the call is then run eagerly."""
        try:
            out = call(*args, **kwargs)
        except Exception as e:  # dynamo's and inductor's failures are many classes; an eager error raises again below
            return self._fall_back(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
                                   call, args, kwargs)
        if self._checked < CHECKED_CALLS:
            self._checked += 1
            if not _finite(out):
                return self._fall_back("its outputs were not finite", call, args, kwargs, check_eager=True)
        return out

    def _compile(self, module: nn.Module) -> None:
        """Its forward compiled, on the instance: the script's references to the model stay the same object. (Not
        `nn.Module.compile()`: on torch 2.13 its compiled `_call_impl` ran without dynamo compiling a frame.)"""
        module.forward = torch.compile(module.forward)
        self._compiled = True

    def _uncompile(self) -> None:
        if self.model is not None and "forward" in self.model.__dict__:
            del self.model.forward  # the class's forward again
        self._compiled = False

    def _fall_back(self, why: str, call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                   check_eager: bool = False) -> Any:
        assert self.model is not None
        self._uncompile()
        out = call(*args, **kwargs)
        if check_eager and not _finite(out):  # eager's are not finite either: the model's own, not the compile's
            self._compile(self.model)
            self._checked = CHECKED_CALLS
            return out
        self.injected.fell_back = why
        self.events.append(f"torch.compile fell back to eager: {why}")
        return out


def _put_back(cls: type, name: str, ours: Any) -> Callable[[], None]:
    """The undo of `setattr(cls, name, ours)`, done only while `ours` is still there: a patch made after it (the
    doctor's own, in a `--verify` run) and undone before it would otherwise be put back, stale, by this undo."""
    had, saved = name in cls.__dict__, cls.__dict__.get(name)

    def undo() -> None:
        if cls.__dict__.get(name) is ours:
            if had:
                setattr(cls, name, saved)
            else:
                delattr(cls, name)
    return undo


class _ModelFinder:
    """`nn.Module.__call__` wrapped until the model's first training call (module doc)."""

    def __init__(self, fixes: ModelFixes, stack: ExitStack) -> None:
        self.fixes, self.stack = fixes, stack
        self.original = nn.Module.__call__
        finder = self

        def call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:  # (a function: bound as a method)
            return finder.call(module, *args, **kwargs)
        self.patch = mock.patch.object(nn.Module, "__call__", call)
        self.active = False

    def __enter__(self) -> _ModelFinder:
        self.patch.start()
        self.active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.active:
            self.active = False
            self.patch.stop()

    def call(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # A class that wrapped this before the model was found keeps calling it: after that, only pass through
        if not self.active or self.fixes.model is not None or not _trains(module):
            return self.original(module, *args, **kwargs)
        self._stop()
        self.fixes.found(module, self.stack)
        return self.fixes.forward(lambda *a, **k: self.original(module, *a, **k), args, kwargs)


def checked_dtype(key: str, value: Any) -> str:
    """An autocast override's dtype name, or ValueError."""
    if value not in ("bfloat16", "float16"):
        raise ValueError(f"override {key}={value!r}: give 'bfloat16' or 'float16'")
    return str(value)
