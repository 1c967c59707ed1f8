"""`find_batch_size` against a real CUDA out-of-memory error: the search ends below the device's capacity,
returns a batch that fits, and gives every byte back."""

from __future__ import annotations

import pytest
import torch

from helpers import Scale
from trainfast import find_batch_size

GiB = 2**30


@pytest.mark.gpu
def test_find_batch_size_on_a_real_out_of_memory_error() -> None:
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(0)
    # Each sample takes 1/48 of the free memory: a step at batch 8 fits (about half the memory), one at 16 or 32
    # cannot, so the search meets a real OOM within a few tries, each a few large allocations and no real compute.
    # Three dimensions per batch, so the default loss is the output's mean (a 2-D output would be taken for class
    # logits and add a softmax over them).
    sample = torch.ones(free // 48 // 4 // 1024, 1024, device="cuda")
    model = Scale()  # on the CPU: the search moves it to the GPU and back
    allocated_before = torch.cuda.memory_allocated(0)
    result = find_batch_size(model, sample, device="cuda", precision="32-true", max_batch=64)
    tries = [(b, ok) for b, ok, _ in result.tried]
    assert result.first_oom is not None, f"no out-of-memory error up to 64: {tries}"
    assert 1 <= result.batch_size < result.first_oom <= 32, tries
    assert (result.batch_size, True) in tries and (result.first_oom, False) in tries
    assert result.device.startswith("cuda") and result.precision == "32-true"
    # the model is back where it was, without gradients; the failed tries' memory is released
    assert model.w.device.type == "cpu" and model.w.grad is None
    assert torch.cuda.memory_allocated(0) == allocated_before, "tensors of the search are still allocated"
    cached = torch.cuda.memory_reserved(0) - torch.cuda.memory_allocated(0)
    assert cached < GiB // 4, f"{cached / GiB:.2f} GiB left cached by the search"
    # and the size it returned really fits: searching that one size alone succeeds
    again = find_batch_size(model, sample, device="cuda", precision="32-true", start=result.batch_size,
                            max_batch=result.batch_size)
    assert again.batch_size == result.batch_size and again.first_oom is None
    assert torch.cuda.memory_allocated(0) == allocated_before
