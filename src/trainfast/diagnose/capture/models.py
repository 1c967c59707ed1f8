"""The models a script trains, found without its help: the root modules it calls and where their batch is."""

from __future__ import annotations

import gc
import warnings

from torch import nn


def root_modules() -> list[nn.Module]:
    """Every live module with parameters that is no other module's child: the models a script calls (loss and
    metric modules hold no parameters)."""
    with warnings.catch_warnings():  # type() rather than isinstance(): some lazy torch objects warn on __class__
        warnings.simplefilter("ignore")
        modules = [o for o in gc.get_objects() if issubclass(type(o), nn.Module)]
    children: set[int] = set()
    for module in modules:
        children.update(id(c) for c in vars(module).get("_modules", {}).values() if c is not None)
    return [m for m in modules if id(m) not in children and not _compile_internal(m) and _has_parameters(m)]


def _compile_internal(module: nn.Module) -> bool:
    """torch.fx / dynamo's graph modules: torch.compile's insides, called within the compiled frame. The
    `OptimizedModule` that torch.compile returns is the model the script calls, and stays."""
    name = type(module).__module__
    return name.startswith(("torch.fx", "torch._")) and type(module).__name__ != "OptimizedModule"


def batch_axis(model: nn.Module) -> int:
    """Where the batch is in the model's (2- or 3-D) input: 1 for a time-major sequence model, whose first RNN or
    Transformer layer is not `batch_first` (PyTorch's word-language-model example feeds (seq_len, batch) token
    ids), else 0."""
    try:
        for m in model.modules():
            if isinstance(m, nn.RNNBase):
                return 0 if m.batch_first else 1
            if isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
                return 0 if m.self_attn.batch_first else 1
    except Exception:  # a module with its own modules(): assume batch first
        return 0
    return 0


def _has_parameters(module: nn.Module) -> bool:
    try:
        return next(module.parameters(), None) is not None
    except Exception:  # a module left half-built by a failed __init__, or with its own parameters(): not ours
        return False
