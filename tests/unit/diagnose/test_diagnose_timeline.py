"""Timeline accounting (synthetic clock) and the instrumentation's patches (installed, counted, removed)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.optim import optimizer as optimizer_module
from torch.utils.data import ConcatDataset, DataLoader, Subset, TensorDataset, random_split

from trainfast.diagnose.capture.instrument import Instrumentation
from trainfast.diagnose.capture.loader_hook import describe_loader
from trainfast.diagnose.capture.timeline import StopMeasuring, Timeline


def test_step_split_with_a_synthetic_clock(clock: list[float]) -> None:
    tl = Timeline(warmup_steps=1, max_steps=2)
    clock[0] = 101.0
    tl.step_end()  # warm-up: not recorded
    clock[0] = 101.5  # 0.5 s of host work (logging), of which 0.2 s waited in .item()
    tl.synced(0.2)
    tl.fetched(101.5, 102.5, samples=32)  # 1 s data wait
    tl.transferred(0.25)
    tl.synced(0.1)  # inside the compute part: not host time
    clock[0] = 104.0
    tl.step_end()
    [record] = tl.records
    assert (record.total_s, record.wait_s, record.transfer_s, record.samples, record.syncs) == (3.0, 1.0, 0.25, 32, 2)
    assert record.host_s == pytest.approx(0.3) and record.compute_s == pytest.approx(1.45)
    assert not tl.done


def test_stop_when_done_raises_a_base_exception(clock: list[float]) -> None:
    tl = Timeline(warmup_steps=0, max_steps=2)
    tl.stop_when_done = True
    tl.step_end()
    with pytest.raises(StopMeasuring):
        tl.step_end()
    assert not issubclass(StopMeasuring, Exception) and tl.done


def test_a_step_without_a_loader_has_no_host_split(clock: list[float]) -> None:
    tl = Timeline(warmup_steps=0)
    clock[0] = 100.5
    tl.step_end()
    assert tl.records[0].host_s == 0 and tl.records[0].compute_s == 0.5


@pytest.mark.parametrize(("warmup", "steps"), [(-1, None), (0, 0)])
def test_bad_arguments(warmup: int, steps: int | None) -> None:
    with pytest.raises(ValueError, match="need warmup_steps >= 0 and max_steps >= 1"):
        Timeline(warmup_steps=warmup, max_steps=steps)


def snapshot() -> tuple[Any, ...]:
    return (DataLoader.__iter__, dict(vars(torch.Tensor)), torch.amp.GradScaler.step,
            torch.amp.autocast_mode.autocast.__enter__, len(optimizer_module._global_optimizer_post_hooks))


def test_patches_are_removed_even_when_the_loop_raises() -> None:
    before = snapshot()
    with pytest.raises(RuntimeError, match="boom"), Instrumentation(Timeline(warmup_steps=0)):
        assert snapshot() != before
        raise RuntimeError("boom")
    assert snapshot() == before


class OnDevice(torch.Tensor):
    """A tensor that says it lives on a GPU (its data stays on the CPU): reading it is a host-device sync."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


class CountsItems(TensorDataset):
    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        int(self.tensors[1][index])  # a dataset reading a value: data wait, not a sync of the training step
        return super().__getitem__(index)


def test_loader_steps_and_user_syncs_are_measured() -> None:
    data = CountsItems(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())  # its own .item() calls are not counted
    tl = Timeline(warmup_steps=1)
    with Instrumentation(tl) as inst:
        for x, y in DataLoader(data, batch_size=16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            loss.detach().as_subclass(OnDevice).item()  # the script's sync
            loss.item()  # a CPU tensor: nothing to wait for
    assert len(tl.records) == 3 and all(r.samples == 16 for r in tl.records)
    assert all(r.syncs == 1 for r in tl.records)  # the .item() after the step lands in the next step
    [stats] = inst.loaders
    assert (stats.kind, stats.dataset, stats.batches, stats.epochs, stats.in_memory) == (
        "DataLoader", "CountsItems", 4, 1, True)
    assert stats.batch_bytes == 16 * 4 * 4 + 16 * 8 and stats.batches_per_epoch == 4
    assert inst.observed.device == "cpu" and inst.observed.parameters == 10


def test_autocast_and_scaler_are_observed() -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # overflows: the step is skipped
    with Instrumentation(Timeline(warmup_steps=0)) as inst:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(8, 4)).float().pow(2).sum() * 1e30
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    assert ("cpu", "bfloat16") in inst.observed.autocast
    assert inst.observed.scaler_steps == 1 and inst.observed.scaler_skipped() == 1


def test_the_step_closed_as_the_run_ends_leaves_no_class_hooked() -> None:
    """The last step closes only at exit, and closing it finds the model and wraps its class's `__call__`: that
    patch is taken back too. Left on `nn.Linear`, the next doctor run in the process saw its forwards twice, through
    the old run's wrapper (step times of -39 ms, no samples/s)."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Instrumentation(Timeline(warmup_steps=0)):
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
    watched = [cls for cls in (torch.nn.Linear, torch.nn.Module) if "_trainfast_watch" in dir(cls.__call__)]
    assert watched == [] and "__call__" not in vars(torch.nn.Linear)


def test_a_random_split_of_tensors_is_in_memory() -> None:
    """`random_split` is how most scripts make a validation set: its parts are still rows of tensors in RAM (a
    worker process would only add IPC; --verify measured 0.27x for the num_workers advice it got before)."""
    train, val = random_split(TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,))), [48, 16])
    both = ConcatDataset([train, val])
    stats = [describe_loader(DataLoader(d, batch_size=8), i) for i, d in enumerate((train, both))]
    assert [(s.dataset, s.in_memory) for s in stats] == [("Subset of TensorDataset", True), ("ConcatDataset", True)]
    images = describe_loader(DataLoader(Subset(list(range(8)), [0, 1]), batch_size=2), 0)
    assert (images.dataset, images.in_memory) == ("Subset of list", False)


def test_frozen_convolutions_still_count_for_the_memory_format_advice() -> None:
    """Fine-tuning a head on a frozen conv backbone: the optimizer holds the head only, but every convolution runs
    (and gains from channels_last)."""
    backbone = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3),
                                   torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()).requires_grad_(False)
    model = torch.nn.Sequential(backbone, torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model[1].parameters(), lr=0.1)
    data = TensorDataset(torch.randn(32, 3, 8, 8), torch.randint(0, 2, (32,)))
    with Instrumentation(Timeline(warmup_steps=1)) as inst:
        for x, y in DataLoader(data, batch_size=8):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert inst.observed.conv_weights == 2 and inst.observed.parameters == 8 * 2 + 2


def test_a_batch_of_point_clouds_is_counted_per_cloud() -> None:
    """A collate that returns (list of (N_i, 3) clouds, labels): 4 samples per batch, not the first cloud's N."""
    clouds = [torch.randn(50 + 7 * i, 3) for i in range(16)]
    data = list(zip(clouds, torch.randint(0, 2, (16,)).tolist(), strict=True))
    loader = DataLoader(data, batch_size=4, collate_fn=lambda b: ([c for c, _ in b], torch.tensor([y for _, y in b])))
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tl = Timeline(warmup_steps=1)
    with Instrumentation(tl):
        for points, labels in loader:
            logits = torch.stack([model(p).mean(0) for p in points])
            torch.nn.functional.cross_entropy(logits, labels).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert tl.records and all(r.samples == 4 for r in tl.records)
