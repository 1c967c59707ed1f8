"""The channels_last A/B switches the model's layout back and forth on its first steps; an optimizer's moments must
follow every switch. CPU's fused AdamW (the CPU twin of the Trainer's default CUDA optimizer) does not check strides
and updates the wrong elements when a moment's layout differs from its parameter's; CUDA's fused kernel raises. The
step pre-hook here copies CUDA's check, so the CPU run fails where a GPU run would crash."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainfast.loader.memory import TensorLoader
from trainfast.trainer.config import TrainConfig
from trainfast.trainer.loop import Trainer

STEPS = 32  # over MIN_RUN_MULTIPLE x MAX_STEPS (3 x 10): the layout A/B runs


def conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 1), nn.Flatten(),
                         nn.Linear(8 * 6 * 6, 4))


def loader() -> TensorLoader:
    g = torch.Generator().manual_seed(0)
    n = STEPS * 4
    return TensorLoader((torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 4, (n,), generator=g)), 4,
                        shuffle=False)


def same_strides(size: torch.Size, left: tuple[int, ...], right: tuple[int, ...]) -> bool:
    """As CUDA's fused kernels compare strides (ForeachUtils.h): dimensions of size 1 do not count."""
    return all(n == 1 or a == b for n, a, b in zip(size, left, right, strict=True))


def strides_checked(optimizer: torch.optim.Optimizer, seen: list[int]) -> None:
    """CUDA's fused AdamW refuses a gradient or state tensor whose strides differ from its parameter's
    (RuntimeError: "params, grads, exp_avgs, and exp_avg_sqs must have same dtype, device, and layout"); so here."""
    def check(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        seen.append(1)
        for group in opt.param_groups:
            for p in group["params"]:
                tensors = {"grad": p.grad, **opt.state.get(p, {})}
                for key, value in tensors.items():
                    if (isinstance(value, torch.Tensor) and value.dim() > 0
                            and not same_strides(p.shape, value.stride(), p.stride())):
                        raise RuntimeError(f"fused AdamW: {key} strides {value.stride()} differ from the "
                                           f"parameter's {p.stride()}")
    optimizer.register_step_pre_hook(check)


def train(fused: bool, *, checked: bool = True) -> tuple[nn.Module, dict[str, Any]]:
    model = conv_net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=fused)
    seen: list[int] = []
    if checked:
        strides_checked(optimizer, seen)
    config = TrainConfig(epochs=1, progress=False, device="cpu", precision="32-true", channels_last="auto",
                         grad_clip=None, warmup_steps=0)
    result = Trainer(model, optimizer, config=config).fit(loader()).to_json()
    assert len(seen) == (STEPS if checked else 0)
    return model, result


def test_a_fused_optimizer_never_steps_with_a_moment_in_another_layout() -> None:
    _, result = train(fused=True)
    layout = result["channels_last"]
    assert layout["measured"] is True, layout["reason"]  # the A/B ran: both layouts were trained in


def test_fused_and_plain_adamw_give_the_same_weights_through_the_layout_ab() -> None:
    fused, result = train(fused=True, checked=False)  # CPU's fused kernel updates whatever it is given
    plain, _ = train(fused=False, checked=False)
    assert result["channels_last"]["steps"] > 0  # the A/B ran: both layouts were trained in
    for a, b in zip(fused.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
