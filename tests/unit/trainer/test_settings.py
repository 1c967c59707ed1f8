"""torch_settings: TF32 (from the precision policy), threads and cudnn.benchmark set for a block, then put back."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from trainfast.precision import DeviceCaps, resolve_precision
from trainfast.trainer.settings import torch_settings

CPU = DeviceCaps("cpu")
TURING = DeviceCaps("cuda", (7, 5), bf16=False)
AMPERE = DeviceCaps("cuda", (8, 0), bf16=True)


@pytest.fixture
def restore_tf32() -> Iterator[None]:
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn


@pytest.mark.parametrize("start_matmul", ["highest", "medium"])
@pytest.mark.parametrize("start_cudnn", [False, True])
def test_tf32_sets_and_restores(restore_tf32: None, start_matmul: str, start_cudnn: bool) -> None:
    torch.set_float32_matmul_precision(start_matmul)
    torch.backends.cudnn.allow_tf32 = start_cudnn
    policy = resolve_precision("auto", AMPERE)
    with torch_settings(tf32=policy.tf32):
        # "medium" already runs CUDA's fp32 matmuls in TF32 (and oneDNN's in bf16): left as the user set it
        assert torch.get_float32_matmul_precision() == ("high" if start_matmul == "highest" else start_matmul)
        assert torch.backends.cudnn.allow_tf32 is True
    assert torch.get_float32_matmul_precision() == start_matmul
    assert torch.backends.cudnn.allow_tf32 is start_cudnn


def test_tf32_restores_after_an_exception(restore_tf32: None) -> None:
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    with pytest.raises(RuntimeError, match="boom"), torch_settings(tf32=resolve_precision("auto", AMPERE).tf32):
        assert torch.get_float32_matmul_precision() == "high"
        raise RuntimeError("boom")
    assert torch.get_float32_matmul_precision() == "highest"
    assert torch.backends.cudnn.allow_tf32 is False


@pytest.mark.parametrize("caps", [CPU, TURING])
def test_tf32_is_a_no_op_without_tf32(restore_tf32: None, caps: DeviceCaps) -> None:
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    with torch_settings(tf32=resolve_precision("auto", caps).tf32):
        assert torch.get_float32_matmul_precision() == "highest"
        assert torch.backends.cudnn.allow_tf32 is False
    assert torch.get_float32_matmul_precision() == "highest"


def test_threads_and_benchmark_restored() -> None:
    threads, benchmark = torch.get_num_threads(), torch.backends.cudnn.benchmark
    with torch_settings(cpu_threads=1, cudnn_benchmark=not benchmark):
        assert torch.get_num_threads() == 1 and torch.backends.cudnn.benchmark is (not benchmark)
    assert torch.get_num_threads() == threads and torch.backends.cudnn.benchmark is benchmark


def test_explicit_32_true_keeps_full_fp32_on_ampere() -> None:
    assert not resolve_precision("32-true", AMPERE).tf32
    assert resolve_precision("auto", AMPERE).tf32
