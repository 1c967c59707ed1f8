"""The fixes `apply_overrides` injects into the model and the checkpoint writes of an unmodified loop
(capture/inject_model.py, capture/inject_save.py): the model found at its first training forward, each fix in effect
from that forward on, and everything put back after."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import optimizer as optimizer_module

from trainfast.diagnose.capture.inject import apply_overrides, check_overrides, merge_overrides

CL = torch.channels_last


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4, 2)
        self.seen: list[tuple[torch.dtype, bool]] = []  # each forward's conv output: dtype, NHWC

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        self.seen.append((h.dtype, h.is_contiguous(memory_format=CL) and not h.is_contiguous()))
        return self.head(h.mean((2, 3)))


def _untouched() -> tuple[object, ...]:
    return (nn.Module.__call__, Net.__dict__.get("__call__"), torch.save, os.replace, torch.load,
            len(optimizer_module._global_optimizer_pre_hooks))


def _step(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    out = net(x)
    out.float().sum().backward()
    opt.step()
    opt.zero_grad()
    return out


def test_the_trained_model_takes_channels_last_and_bf16_from_its_first_forward_and_all_is_put_back() -> None:
    """A frozen teacher called first is not the model; the trained one gets NHWC weights, NHWC inputs and bf16
    compute, its outputs back in float32 (the script's loss runs as before), and its moments (a resumed run's,
    loaded NCHW) follow its layout before the fused step that walks them by their strides."""
    before = _untouched()
    teacher, net = Net().requires_grad_(False), Net()
    opt = torch.optim.AdamW(net.parameters(), fused=True)
    _step(net, opt, torch.randn(2, 3, 6, 6))  # state as a resumed run loads it: NCHW moments
    net.seen.clear()
    x = torch.randn(2, 3, 6, 6)
    with apply_overrides({"memory_format": "channels_last", "autocast": "bfloat16"}) as injected:
        teacher(x)
        out = _step(net, opt, x)
        _step(net, opt, x)
        assert opt.state[net.conv.weight]["exp_avg"].is_contiguous(memory_format=CL)
    assert out.dtype == torch.float32 and net.seen == [(torch.bfloat16, True)] * 2 and teacher.seen == [
        (torch.float32, False)]
    assert net.conv.weight.is_contiguous(memory_format=CL) and injected.model == "Net"
    assert "channels_last" in injected.events[0] and "bfloat16 autocast" in injected.events[0]
    assert _untouched() == before


def test_evaluation_forwards_run_under_inference_mode_and_autocast_and_give_ordinary_tensors() -> None:
    """A no_grad forward (evaluation, a rollout) under inference_mode + bf16: its outputs are float32 and not
    inference tensors, so a script that later trains on them (a rollout's values as targets) still can."""
    net = Net()
    x = torch.randn(2, 3, 6, 6)
    with apply_overrides({"eval_autocast": "bfloat16"}):
        net(x).sum().backward()  # the model found, trained in its own precision
        with torch.no_grad():
            values = net(x)
        (net(x) - values).pow(2).sum().backward()  # the rollout's values as targets
    assert net.seen[0][0] == torch.float32 and net.seen[1][0] == torch.bfloat16
    assert values.dtype == torch.float32 and not values.is_inference()


def test_a_model_evaluated_first_is_found_at_its_first_training_forward() -> None:
    net = Net()
    with apply_overrides({"autocast": "bfloat16"}) as injected:
        with torch.no_grad():
            net(torch.randn(1, 3, 6, 6))  # a sanity evaluation before training: not the model's first training call
        assert injected.model is None
        net(torch.randn(1, 3, 6, 6))
    assert injected.model == "Net" and [dtype for dtype, _ in net.seen] == [torch.float32, torch.bfloat16]


@pytest.mark.torch_compile
def test_a_compile_that_fails_falls_back_to_eager_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """No working C++ compiler (a container without one): inductor fails at the first call; the call runs eagerly
    and the reason is kept for the report."""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # a cached kernel would need no compiler
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with inductor_config.patch({"cpp.cxx": (None, "/nonexistent/g++")}), \
            apply_overrides({"compile": True}) as injected:
        for _ in range(2):
            net(torch.randn(3, 4)).sum().backward()
    assert injected.fell_back is not None and "compiler" in injected.fell_back.lower(), injected.events
    assert injected.events[-1].startswith("torch.compile fell back to eager: ")
    assert "forward" not in net.__dict__  # the class's own forward again


def test_checkpoints_are_written_in_the_background_and_a_rename_waits_for_the_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The save returns after the copy; the write goes on in a thread; the script's rename of its temporary file
    (the usual atomic save) waits for it, and the file it renamed holds what was saved at the save, not after."""
    before = _untouched()
    original = torch.save
    writing = threading.Event()

    def slow_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        writing.set()
        time.sleep(0.2)
        original(obj, f, *args, **kwargs)
    monkeypatch.setattr(torch, "save", slow_save)
    weights = torch.zeros(3)
    with apply_overrides({"async_checkpoint": True}) as injected:
        started = time.perf_counter()
        torch.save({"w": weights}, tmp_path / "tmp.pt")
        returned = time.perf_counter() - started
        weights += 1  # training goes on, changing what was saved
        assert writing.wait(5)
        os.replace(tmp_path / "tmp.pt", tmp_path / "last.pt")
        torch.save(nn.Linear(1, 1), tmp_path / "model.pt")  # a whole module: written as asked, synchronously
    assert returned < 0.15 and torch.equal(torch.load(tmp_path / "last.pt")["w"], torch.zeros(3))
    assert (tmp_path / "model.pt").exists() and "1 torch.save call(s) written in the background" in injected.events[0]
    monkeypatch.undo()
    assert _untouched() == before


def test_a_background_write_that_fails_is_raised_not_lost(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"the checkpoint written in the background to .* failed"), \
            apply_overrides({"async_checkpoint": True}):
        torch.save({"w": torch.zeros(1)}, tmp_path / "no-such-folder" / "x.pt")


@pytest.mark.parametrize(("overrides", "message"), [
    ({"memory_format": "nhwc"}, "give one of channels_last, contiguous"),
    ({"autocast": "float16"}, "float16 needs a GradScaler"),
    ({"eval_autocast": "fp8"}, "give 'bfloat16' or 'float16'"),
    ({"compile": "yes"}, "give true or false"),
])
def test_bad_model_overrides_are_named(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_overrides(overrides)


def test_merged_overrides_keep_the_first_ranked_value_and_say_what_was_left_out() -> None:
    merged, dropped = merge_overrides([("num_workers", {"num_workers": 4, "threads": 1}), ("threads", {"threads": 2}),
                                       ("channels_last", {"memory_format": "channels_last"})])
    assert merged == {"num_workers": 4, "threads": 1, "memory_format": "channels_last"}
    assert dropped == ["threads's threads=2 left out: num_workers, ranked above it, sets threads=1"]
