"""The CUDA RNG state in a checkpoint is the training GPU's only: saved from it, restored onto it, also on a machine
with fewer GPUs, and from an older checkpoint that held every visible GPU's state.

torch has no CPU twin of `torch.cuda`'s per-device generators, so `FakeCuda` stands in: one CPU
`torch.Generator` per GPU (whose `set_state` makes torch's own check: a CPU ByteTensor of the generator's size),
looked up as `torch.cuda.get_rng_state` / `set_rng_state` do (`default_generators[index]`, IndexError past the last
GPU; no index: the current GPU).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch

from trainfast.trainer import checkpoint
from trainfast.trainer.checkpoint import atomic_save, load_checkpoint, rng_state, set_rng_state


class FakeCuda:
    def __init__(self, count: int, current: int = 0) -> None:
        self.generators = tuple(torch.Generator().manual_seed(1000 + i) for i in range(count))
        self.current = current
        self.calls: list[tuple[str, int]] = []

    def _index(self, device: int | str | torch.device) -> int:
        device = torch.device(device) if isinstance(device, str) else device
        device = torch.device("cuda", device) if isinstance(device, int) else device
        return self.current if device.index is None else device.index

    def get_rng_state(self, device: int | str | torch.device = "cuda") -> torch.Tensor:
        index = self._index(device)
        self.calls.append(("get", index))
        return self.generators[index].get_state()

    def set_rng_state(self, new_state: torch.Tensor, device: int | str | torch.device = "cuda") -> None:
        index = self._index(device)
        self.calls.append(("set", index))
        self.generators[index].set_state(new_state)

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [self.get_rng_state(i) for i in range(len(self.generators))]

    def set_rng_state_all(self, new_states: Iterable[torch.Tensor]) -> None:
        for i, state in enumerate(new_states):
            self.set_rng_state(state, i)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(self.generators))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        for name in ("get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        return self


@pytest.fixture(autouse=True)
def saved_rngs_and_warnings(saved_rngs: None) -> Iterator[None]:
    """The global RNGs (tests/conftest.py's `saved_rngs`) and the set of devices already warned about."""
    warned = set(checkpoint._warned_missing_cuda_state)
    yield
    checkpoint._warned_missing_cuda_state.clear()
    checkpoint._warned_missing_cuda_state.update(warned)


def draw(generator: torch.Generator) -> list[float]:
    return torch.rand(3, generator=generator).tolist()


def old_checkpoint_rng(gpus: FakeCuda) -> dict[str, object]:
    """The RNG entry checkpoints held before: every visible GPU's CUDA state, in index order."""
    state = rng_state()  # no CUDA here (the fake is not installed yet)
    state.pop("cuda_device", None)
    state["cuda"] = gpus.get_rng_state_all()
    return state


def test_only_the_training_gpus_state_is_saved(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = FakeCuda(4).install(monkeypatch)
    state = rng_state(torch.device("cuda", 2))
    assert state["cuda_device"] == 2 and len(state["cuda"]) == 1
    assert torch.equal(state["cuda"][0], gpus.generators[2].get_state())
    assert gpus.calls == [("get", 2)]


def test_off_the_gpu_no_cuda_state_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = FakeCuda(2).install(monkeypatch)
    state = rng_state(torch.device("cpu"))
    assert state["cuda"] == [] and state["cuda_device"] is None and gpus.calls == []
    set_rng_state(state, torch.device("cpu"))
    assert gpus.calls == []


def test_resume_on_a_machine_with_fewer_gpus_lands_on_the_training_gpu(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    """Rank 3 of a 4-GPU machine saved its state; on a 2-GPU machine the same rank trains on cuda:1."""
    saver = FakeCuda(4).install(monkeypatch)
    path = atomic_save({"model": {}, "rng": rng_state(torch.device("cuda", 3))}, tmp_path / "c.pt")
    expected = draw(saver.generators[3])
    resumer = FakeCuda(2).install(monkeypatch)
    untouched = resumer.generators[0].get_state()
    set_rng_state(load_checkpoint(path)["rng"], torch.device("cuda", 1))  # weights_only load
    assert draw(resumer.generators[1]) == expected
    assert torch.equal(resumer.generators[0].get_state(), untouched)
    assert ("set", 1) in resumer.calls and ("set", 0) not in resumer.calls


def test_an_old_checkpoint_of_more_gpus_restores_the_training_gpus_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Saved with every GPU's state on 4 GPUs; resumed on 2 without naming the device (the current GPU is the
    training one after torch.cuda.set_device): no IndexError, and cuda:1 gets entry 1."""
    state = old_checkpoint_rng(FakeCuda(4))
    expected = draw(torch.Generator().manual_seed(1001))  # entry 1: GPU 1's generator as the old run left it
    resumer = FakeCuda(2, current=1).install(monkeypatch)
    untouched = resumer.generators[0].get_state()
    set_rng_state(state)
    assert draw(resumer.generators[1]) == expected
    assert torch.equal(resumer.generators[0].get_state(), untouched)


def test_an_old_checkpoint_without_the_training_gpus_entry_warns_once(monkeypatch: pytest.MonkeyPatch,
                                                                     trainfast_log: pytest.LogCaptureFixture) -> None:
    state = old_checkpoint_rng(FakeCuda(1))
    resumer = FakeCuda(4).install(monkeypatch)
    before = resumer.generators[3].get_state()
    set_rng_state(state, torch.device("cuda", 3))
    set_rng_state(state, torch.device("cuda", 3))
    assert torch.equal(resumer.generators[3].get_state(), before)
    warnings = [r.getMessage() for r in trainfast_log.records if r.levelno == logging.WARNING]
    assert warnings == [
        "resume: the checkpoint holds the CUDA RNG states of GPUs 0 to 0 (written before a checkpoint kept only the "
        "training GPU's) and none for cuda:3, the GPU training here: its generator keeps its current state, so random "
        "draws on the GPU (dropout) differ from an uninterrupted run; everything else resumes exactly. For identical "
        "draws, resume on a GPU index below 1"]


def test_a_cuda_state_in_another_dtype_reaches_the_generator_as_a_cpu_byte_tensor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = FakeCuda(2).install(monkeypatch)
    state = rng_state(torch.device("cuda", 0))
    expected = draw(torch.Generator().manual_seed(1000))
    state["cuda"] = [state["cuda"][0].to(torch.int64)]
    draw(gpus.generators[0])  # move the stream on
    set_rng_state(state, torch.device("cuda", 0))
    assert draw(gpus.generators[0]) == expected
