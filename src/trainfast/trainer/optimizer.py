"""The default optimizer: AdamW with decoupled weight decay on matrices and kernels only."""

from __future__ import annotations

import torch
from torch import nn


def default_optimizer(model: nn.Module, lr: float, weight_decay: float, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices and kernels only (decaying biases and norm gains only hurts)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # fused: one kernel for all parameters on CUDA instead of a launch per tensor
    return torch.optim.AdamW(groups, lr=lr, fused=device.type == "cuda")
