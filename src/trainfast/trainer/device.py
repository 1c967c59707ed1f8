"""Resolve the `device` setting ("auto" | "cpu" | "cuda" | "cuda:N") to a torch.device."""

from __future__ import annotations

import os

import torch

from trainfast.trainer.config import ConfigError


def resolve_device(spec: str) -> torch.device:
    """"auto" is the GPU torchrun assigned (LOCAL_RANK), else the current GPU, else the CPU."""
    if spec == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={spec!r} but CUDA is not available (torch {torch.__version__}); "
                              "use device='cpu' or 'auto'")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ConfigError(f"device={spec!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")
        device = torch.device("cuda", index)
    return device
