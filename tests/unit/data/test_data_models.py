"""Reference models: output shapes for every name and input size, error for unknown names, a working backward."""

from __future__ import annotations

import pytest
import torch

from trainfast.data.models import MLP, MODELS, ConvNet, build_model


@pytest.mark.parametrize("image_size", [32, 64])
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("num_classes", [10, 3])
def test_build_model_outputs_batch_by_num_classes(name: str, image_size: int, num_classes: int) -> None:
    torch.manual_seed(0)
    model = build_model(name, num_classes=num_classes, image_size=image_size)
    assert isinstance(model, torch.nn.Module)
    x = torch.randn(4, 3, image_size, image_size)
    with torch.no_grad():
        out = model.eval()(x)
    assert out.shape == (4, num_classes)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()


def test_model_names_map_to_their_classes() -> None:
    assert set(MODELS) == {"convnet", "mlp"}
    assert isinstance(build_model("convnet", num_classes=10, image_size=32), ConvNet)
    assert isinstance(build_model("mlp", num_classes=10, image_size=32), MLP)


@pytest.mark.parametrize("name", ["resnet50", "ConvNet", "", "conv net"])
def test_unknown_model_lists_the_choices(name: str) -> None:
    with pytest.raises(ValueError, match=rf"unknown model {name!r}; choose one of: convnet, mlp"):
        build_model(name, num_classes=10, image_size=32)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_convnet_backward_reaches_every_parameter(memory_format: torch.memory_format) -> None:
    torch.manual_seed(0)
    model = build_model("convnet", num_classes=10, image_size=32).to(memory_format=memory_format)
    x = torch.randn(4, 3, 32, 32).contiguous(memory_format=memory_format)
    y = torch.tensor([0, 1, 2, 3])
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())  # type: ignore[union-attr]


def test_convnet_learns_a_fixed_batch() -> None:
    torch.manual_seed(0)
    model = build_model("convnet", num_classes=4, image_size=32)
    x, y = torch.randn(8, 3, 32, 32), torch.arange(8) % 4
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.5


def test_mlp_input_size_follows_image_size() -> None:
    model = build_model("mlp", num_classes=10, image_size=16)
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 10)
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 3, 32, 32))
