"""Out of memory inside `fit`: one error that says where, what the allocator held and what to change, with the
last checkpoint left as it was; the CLI prints it without a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from trainfast import TrainConfig, Trainer, make_loader
from trainfast.oom import MemorySnapshot
from trainfast.trainer import TrainingOutOfMemoryError, out_of_memory

GiB = 2**30
CPU_OOM = ("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate "
           "4294967296 bytes. Error code 12 (Cannot allocate memory)")
CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 16.00 GiB\nmore hints"


class RunsOutAt(nn.Module):
    """A linear model whose `at`-th training forward fails as an allocator would."""

    def __init__(self, at: int, error: Exception) -> None:
        super().__init__()
        self.linear, self.at, self.error, self.calls = nn.Linear(4, 2), at, error, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += self.training
        if self.calls == self.at:
            raise self.error
        return self.linear(x)


def train(model: nn.Module, tmp_path: Path) -> Trainer:
    cfg = TrainConfig(epochs=2, device="cpu", progress=False, monitor=False, checkpoint_dir=str(tmp_path))
    trainer = Trainer(model, config=cfg)
    g = torch.Generator().manual_seed(0)
    trainer.fit(make_loader((torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)), 8,
                            device="cpu"))
    return trainer


def test_an_oom_in_fit_says_where_what_to_change_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(TrainingOutOfMemoryError) as caught:
        train(RunsOutAt(6, RuntimeError(CPU_OOM)), tmp_path)  # 4 batches per epoch: the 2nd of epoch 2
    message = str(caught.value)
    assert isinstance(caught.value, torch.OutOfMemoryError) and isinstance(caught.value.__cause__, RuntimeError)
    assert "out of memory on cpu at epoch 2, step 5 (batch size 8): [enforce fail" in message
    assert "trainfast.find_batch_size(model, sample)" in message and "accumulate=N" in message
    assert f"{str(tmp_path / 'last.pt')!r} is untouched" in message
    assert torch.load(tmp_path / "last.pt", weights_only=True)["step"] == 4  # epoch 1's, as it was


def test_fragmentation_at_the_oom_names_expandable_segments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(out_of_memory, "memory_at_oom", lambda device: MemorySnapshot(6 * GiB, 14 * GiB, 16 * GiB))
    with pytest.raises(TrainingOutOfMemoryError) as caught:
        train(RunsOutAt(2, torch.OutOfMemoryError(CUDA_OOM)), tmp_path)
    message = str(caught.value)
    assert "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 16.00 GiB." in message
    assert "more hints" not in message  # torch's pages of hints stay in the cause
    assert "6.0 GiB allocated by tensors, 14.0 GiB reserved by torch, of 16.0 GiB" in message
    assert "8.0 GiB of the 14.0 GiB torch reserved was cached but in blocks too small" in message
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in message
    assert "no checkpoint was written yet" in message


def test_other_errors_pass_through_unchanged(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="mat1 and mat2") as caught:
        train(RunsOutAt(2, RuntimeError("mat1 and mat2 shapes cannot be multiplied")), tmp_path)
    assert not isinstance(caught.value, TrainingOutOfMemoryError)
