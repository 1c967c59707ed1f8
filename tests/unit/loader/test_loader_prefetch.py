"""prefetch.py: input conversion on the CPU, and the CUDA copy/compute overlap checked through fakes (no GPU needed)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import trainfast.loader.prefetch as prefetch
from trainfast.loader import DevicePrefetcher
from trainfast.loader.prefetch import Normalize, move


def uint8_images(n: int = 2, size: int = 16) -> torch.Tensor:
    values = torch.arange(n * 3 * size * size) % 256  # every uint8 value appears
    return values.to(torch.uint8).view(n, 3, size, size)


def reference(x: torch.Tensor, norm: Normalize) -> torch.Tensor:
    mean = torch.tensor(norm.mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(norm.std, dtype=torch.float32).view(1, -1, 1, 1)
    return (x.float() / 255 - mean) / std


# ---------------------------------------------------------------------------------------------------------- CPU path

@pytest.mark.parametrize("norm", [Normalize(), Normalize(mean=(0.5, 0.5, 0.5), std=(0.5, 0.25, 1.0))])
@pytest.mark.parametrize("channels_last", [False, True])
def test_cpu_normalises_uint8_inputs(norm: Normalize, channels_last: bool) -> None:
    x, y = uint8_images(), torch.tensor([3, 7])
    (out_x, out_y), = list(DevicePrefetcher([(x, y)], "cpu", normalize=norm, channels_last=channels_last))
    assert out_x.dtype == torch.float32 and out_x.shape == x.shape
    torch.testing.assert_close(out_x, reference(x, norm), atol=1e-6, rtol=0)
    assert out_y is y or (torch.equal(out_y, y) and out_y.dtype == y.dtype)  # targets untouched
    assert out_x.is_contiguous(memory_format=torch.channels_last) is channels_last


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_cpu_channels_last_without_normalize(dtype: torch.dtype) -> None:
    x = uint8_images().to(dtype)
    (out_x, _), = list(DevicePrefetcher([(x, torch.zeros(2))], "cpu", channels_last=True))
    assert out_x.is_contiguous(memory_format=torch.channels_last)
    assert out_x.dtype == dtype  # no normalize: no conversion
    assert torch.equal(out_x, x)


@pytest.mark.parametrize(("batch", "description"), [
    ((uint8_images().float(), torch.tensor([1, 2])), "float inputs"),
    ([uint8_images().double(), torch.tensor([1, 2])], "float64 inputs in a list"),
    ((torch.arange(6, dtype=torch.int64).view(2, 3), torch.tensor([1, 2])), "int64 inputs"),
    (uint8_images(), "a bare tensor"),
    ({"image": uint8_images(), "label": torch.tensor([1, 2])}, "a dict"),
    ((), "an empty tuple"),
    (("not a tensor", uint8_images()), "a tuple led by a non-tensor"),
    (42, "a non-tensor"),
])
def test_cpu_passes_other_batches_through(batch: Any, description: str) -> None:
    out, = list(DevicePrefetcher([batch], "cpu", normalize=Normalize()))
    assert type(out) is type(batch), description
    if isinstance(batch, torch.Tensor):
        assert torch.equal(out, batch) and out.dtype == batch.dtype
    elif isinstance(batch, dict):
        assert out.keys() == batch.keys()
        assert all(torch.equal(out[k], batch[k]) and out[k].dtype == batch[k].dtype for k in batch)
    elif isinstance(batch, (tuple, list)):
        assert len(out) == len(batch)
        for a, b in zip(out, batch, strict=True):
            if isinstance(b, torch.Tensor):
                assert torch.equal(a, b) and a.dtype == b.dtype
            else:
                assert a == b
    else:
        assert out == batch


def test_cpu_keeps_list_batches_lists() -> None:
    out, = list(DevicePrefetcher([[uint8_images(), torch.tensor([1, 2])]], "cpu", normalize=Normalize()))
    assert isinstance(out, list) and out[0].dtype == torch.float32


def test_cpu_extra_items_untouched() -> None:
    x, y, w = uint8_images(), torch.tensor([1, 2]), torch.tensor([0.5, 2.0])
    out = next(iter(DevicePrefetcher([(x, y, w)], "cpu", normalize=Normalize())))
    assert len(out) == 3 and torch.equal(out[1], y) and torch.equal(out[2], w)


def test_len_and_order() -> None:
    batches = [(torch.full((1, 3, 2, 2), i, dtype=torch.uint8), torch.tensor([i])) for i in range(3)]
    p = DevicePrefetcher(batches, "cpu")
    assert len(p) == 3
    assert [int(b[1]) for b in p] == [0, 1, 2]
    assert [int(b[1]) for b in p] == [0, 1, 2]  # iterable again


def test_cpu_empty_loader() -> None:
    assert list(DevicePrefetcher([], "cpu", normalize=Normalize())) == []


def test_move_keeps_structure() -> None:
    batch = {"a": (torch.zeros(2), [torch.ones(1), "text"]), "b": 3}
    out = move(batch, torch.device("cpu"))
    assert out.keys() == batch.keys() and out["b"] == 3
    assert isinstance(out["a"], tuple) and isinstance(out["a"][1], list) and out["a"][1][1] == "text"
    assert torch.equal(out["a"][0], torch.zeros(2))


# -------------------------------------------------------------------------------------------- CUDA path, with fakes

class FakeStream:
    def __init__(self, name: str, events: list[tuple[Any, ...]]) -> None:
        self.name, self.events = name, events

    def wait_stream(self, other: FakeStream) -> None:
        self.events.append(("wait", self.name, other.name))


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Fakes for the CUDA stream API, `move` and `record_stream`; returns the list of events they record.

    Batches are tuples whose first tensor holds the batch number: `move` records ("copy", n, non_blocking, stream).
    """
    events: list[tuple[Any, ...]] = []
    compute = FakeStream("compute", events)
    current: list[str | None] = [None]
    created: list[Any] = []

    def new_stream(device: Any = None, **kwargs: Any) -> FakeStream:
        created.append(device)
        events.append(("new stream", torch.device(device).type if device is not None else None))
        return FakeStream("side", events)

    @contextmanager
    def stream(s: FakeStream) -> Iterator[None]:
        before, current[0] = current[0], s.name
        try:
            yield
        finally:
            current[0] = before

    def fake_move(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
        events.append(("copy", int(batch[0].flatten()[0]), non_blocking, current[0]))
        return batch

    def record_stream(self: torch.Tensor, s: FakeStream) -> None:
        events.append(("record", id(self), s.name))

    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(prefetch, "move", fake_move)
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    return events


def cuda_batches(n: int) -> list[tuple[Any, ...]]:
    return [(torch.full((2, 3), i), {"label": torch.tensor([i, i]), "weight": torch.ones(2)}) for i in range(n)]


@pytest.mark.parametrize("n", [1, 2, 5])
def test_cuda_copies_the_next_batch_before_yielding(fake_cuda: list[tuple[Any, ...]], n: int) -> None:
    events = fake_cuda
    batches = cuda_batches(n)
    prefetcher = DevicePrefetcher(batches, "cuda")
    assert prefetcher.device == torch.device("cuda")
    yielded = []
    for batch in prefetcher:
        number = int(batch[0][0, 0])
        events.append(("yield", number))
        yielded.append(batch)
    assert [int(b[0][0, 0]) for b in yielded] == list(range(n))
    assert events[0] == ("new stream", "cuda")

    def at(event: tuple[Any, ...]) -> int:
        assert events.count(event) == 1, f"{event} should happen exactly once in {events}"
        return events.index(event)

    copies = [e for e in events if e[0] == "copy"]
    assert copies == [("copy", i, True, "side") for i in range(n)]  # async, on the side stream, once each
    for i in range(n):
        copy_i, yield_i = at(("copy", i, True, "side")), at(("yield", i))
        if i + 1 < n:  # overlap: batch i+1's copy is issued before the consumer gets batch i
            assert at(("copy", i + 1, True, "side")) < yield_i
        if i + 2 < n:  # but only one batch ahead
            assert at(("copy", i + 2, True, "side")) > yield_i
        previous_yield = at(("yield", i - 1)) if i else -1
        window = events[max(copy_i, previous_yield) + 1:yield_i]
        # the compute stream waits for the side stream after batch i was copied, before batch i is used
        assert ("wait", "compute", "side") in window
        # every tensor of batch i is marked as used by the compute stream
        records = {e[1] for e in window if e[0] == "record" and e[2] == "compute"}
        tensors = [batches[i][0], batches[i][1]["label"], batches[i][1]["weight"]]
        assert {id(t) for t in tensors} <= records
    assert sum(e[:2] == ("wait", "compute") for e in events) == n


def test_cuda_empty_loader_yields_nothing(fake_cuda: list[tuple[Any, ...]]) -> None:
    assert list(DevicePrefetcher([], "cuda")) == []
    assert not [e for e in fake_cuda if e[0] in ("copy", "wait", "record")]


def test_cuda_consumer_stopping_early(fake_cuda: list[tuple[Any, ...]]) -> None:
    it = iter(DevicePrefetcher(cuda_batches(5), "cuda"))
    next(it)
    it.close()  # type: ignore[attr-defined]
    assert [e[1] for e in fake_cuda if e[0] == "copy"] == [0, 1]  # nothing fetched beyond one batch ahead


@pytest.mark.parametrize("n", [1, 3])
def test_cuda_side_stream_waits_for_the_compute_stream_before_each_copy(fake_cuda: list[tuple[Any, ...]],
                                                                          n: int) -> None:
    """Every copy (and the transform reading the normalisation tensors) is ordered after the compute stream's work."""
    events = fake_cuda
    list(DevicePrefetcher(cuda_batches(n), "cuda"))
    copies = [i for i, e in enumerate(events) if e[0] == "copy"]
    for previous, copy in zip([0, *copies], copies, strict=False):
        assert ("wait", "side", "compute") in events[previous:copy], events


def test_cuda_normalisation_tensors_are_ordered_before_their_first_read(fake_cuda: list[tuple[Any, ...]],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The affine tensors are written on the default stream in __init__ and read on the side stream."""
    events = fake_cuda

    class RecordingTransform:
        def __init__(self, device: torch.device, normalize: Normalize | None, channels_last: bool) -> None:
            events.append(("affine written", device.type))

        def __call__(self, batch: Any) -> Any:
            events.append(("affine read",))
            return batch

    monkeypatch.setattr(prefetch, "InputTransform", RecordingTransform)
    list(DevicePrefetcher(cuda_batches(2), "cuda", normalize=Normalize()))
    written, wait = events.index(("affine written", "cuda")), events.index(("wait", "side", "compute"))
    first_copy, first_read = events.index(("copy", 0, True, "side")), events.index(("affine read",))
    assert written < wait < first_copy < first_read
