"""trainfast.flops: datasheet peaks (dense, never another GPU's), a measured peak that keeps to its budget, FLOP
counts of known layers, MFU that refuses to exceed 1, and the matmul precision a run uses."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from trainfast import flops
from trainfast.flops import (
    FlopCounter,
    Peak,
    count_flops,
    measured_peak,
    peak_flops,
    precision_of,
    table_peak,
    utilisation,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(("name", "precision", "tflops"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),  # SXM5: dense, not the 1,979 "with sparsity"
    ("NVIDIA H100 80GB HBM3", "tf32", 494.7),
    ("NVIDIA H100 80GB HBM3", "fp32", 66.9),
    ("NVIDIA H100 PCIe", "bf16", 756.5),
    ("NVIDIA H100 NVL", "bf16", 835.5),
    ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156),
    ("NVIDIA A100-SXM4-40GB", "bf16", 312),
    ("NVIDIA A100-PCIE-40GB", "fp16", 312),
    ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
    ("NVIDIA A10", "bf16", 125),
    ("NVIDIA A10G", "bf16", 70),
    ("NVIDIA L4", "bf16", 121),
    ("NVIDIA L40S", "bf16", 362.05),
    ("Tesla V100-SXM2-16GB", "fp16", 125),
    ("Tesla V100-PCIE-32GB", "fp16", 112),
    ("Tesla T4", "fp16", 65),
    ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
    ("NVIDIA GeForce RTX 3090", "tf32", 35.6),
    ("NVIDIA RTX A6000", "bf16", 154.8),
])
def test_table_gives_the_datasheets_dense_figure(name: str, precision: str, tflops: float) -> None:
    peak = table_peak(name, precision)
    assert peak is not None
    assert peak.flops_per_s == pytest.approx(tflops * 1e12)
    assert peak.precision == precision
    assert peak.source.startswith("table: NVIDIA ") and f"dense {precision}" in peak.source


@pytest.mark.parametrize(("name", "precision"), [
    ("NVIDIA H100", "bf16"),  # PCIe or SXM (1.3x apart): no guess
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "bf16"),  # a slice of the SMs
    ("NVIDIA GeForce RTX 4090 D", "bf16"),  # fewer SMs than the 4090
    ("NVIDIA A800-SXM4-80GB", "bf16"),
    ("AMD Instinct MI300X", "bf16"),
    ("Tesla V100-SXM2-16GB", "bf16"),  # Volta has no bf16
    ("Tesla T4", "tf32"),  # nor has Turing TF32
    ("NVIDIA L4", "fp64"),  # not on its datasheet
])
def test_table_returns_none_rather_than_another_figure(name: str, precision: str) -> None:
    assert table_peak(name, precision) is None


def test_every_table_row_orders_its_precisions() -> None:
    """A typo (a sparse figure, a misplaced digit) usually breaks this order."""
    for row, figures in flops._TABLE.items():
        assert set(figures) <= set(flops.PRECISIONS), row
        fp32, tf32, half = figures["fp32"], figures.get("tf32"), figures.get("bf16", figures["fp16"])
        assert fp32 <= (tf32 or fp32) <= half, row
        assert "bf16" not in figures or figures["bf16"] == figures["fp16"], row


def test_peak_flops_on_a_known_gpu_takes_the_table_at_the_runs_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flops, "_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(flops, "measured_peak", lambda *a, **k: pytest.fail("measured a GPU the table knows"))
    assert peak_flops(CUDA, torch.bfloat16).flops_per_s == pytest.approx(989.4e12)
    monkeypatch.setattr(flops, "_tf32_matmul", lambda: True)
    assert peak_flops(CUDA, torch.float32) == table_peak("NVIDIA H100 80GB HBM3", "tf32")
    monkeypatch.setattr(flops, "_tf32_matmul", lambda: False)
    assert peak_flops(CUDA, torch.float32).flops_per_s == pytest.approx(66.9e12)


@pytest.mark.parametrize(("name", "dtype"), [("NVIDIA Future GPU", torch.bfloat16), ("Tesla T4", torch.bfloat16)])
def test_peak_flops_measures_what_the_table_lacks(monkeypatch: pytest.MonkeyPatch, name: str,
                                                  dtype: torch.dtype) -> None:
    measured = Peak(1e12, "bf16", "measured: fake")
    calls: list[tuple[torch.device, torch.dtype]] = []
    monkeypatch.setattr(flops, "_device_name", lambda device: name)

    def measure(device: torch.device, dtype: torch.dtype, **kwargs: object) -> Peak:
        calls.append((device, dtype))
        return measured

    monkeypatch.setattr(flops, "measured_peak", measure)
    assert peak_flops(CUDA, dtype) is measured
    assert calls == [(CUDA, dtype)]


def test_peak_flops_on_the_cpu_is_measured() -> None:
    peak = peak_flops(CPU, torch.float32, threads=1)
    assert peak.source.startswith("measured: ") and "float32" in peak.source and "1 thread," in peak.source
    assert peak.flops_per_s > 0 and peak.precision == "fp32"


@pytest.mark.parametrize(("dtype", "precision"), [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_measured_peak_on_the_cpu_keeps_to_its_budget(dtype: torch.dtype, precision: str) -> None:
    threads, rng = torch.get_num_threads(), torch.random.get_rng_state()
    started = time.perf_counter()
    peak = measured_peak(CPU, dtype, threads=1, budget_s=0.3)
    took = time.perf_counter() - started
    assert peak.flops_per_s > 1e8 and peak.precision == precision  # any CPU of the last 20 years
    assert peak.source.startswith("measured: ") and str(dtype).removeprefix("torch.") in peak.source
    assert "1 thread," in peak.source and "best of " in peak.source
    assert took < 0.3 * 2 + 0.2, f"{took:.2f} s for a 0.3 s budget"  # the last size tried may overrun a little
    assert torch.get_num_threads() == threads  # put back
    assert torch.equal(torch.random.get_rng_state(), rng)  # the caller's random stream untouched


def test_measured_peak_names_the_thread_count_it_ran_with() -> None:
    peak = measured_peak(CPU, torch.float32, threads=2, budget_s=0.1)
    assert "2 threads," in peak.source


def test_count_flops_of_a_linear_layer() -> None:
    batch, inp, out = 8, 32, 16
    layer = nn.Linear(inp, out)
    x = torch.randn(batch, inp, requires_grad=True)
    forward = count_flops(lambda: layer(x))
    assert forward == 2 * batch * inp * out
    # backward: the input's gradient and the weight's, each a matmul of the forward's size
    assert count_flops(lambda: layer(x).sum().backward()) == 3 * forward


def test_flop_counter_started_and_stopped_from_hooks() -> None:
    layer = nn.Linear(32, 16)
    counter = FlopCounter()

    def start(module: nn.Module, args: object) -> None:
        counter.start()

    def stop(module: nn.Module, args: object, out: object) -> None:
        counter.stop()

    layer.register_forward_pre_hook(start)
    layer.register_forward_hook(stop)
    layer(torch.randn(4, 32))
    assert counter.stop() == counter.stop() == 2 * 4 * 32 * 16  # stopping a stopped counter changes nothing
    layer(torch.randn(4, 32))
    assert counter.total == 2 * (2 * 4 * 32 * 16)  # spans add up
    with FlopCounter() as fresh:
        pass
    assert fresh.total == 0


def test_utilisation_is_the_fraction_of_the_peak() -> None:
    peak = Peak(100e12, "bf16", "table: NVIDIA A100, dense bf16 (datasheet)")
    use = utilisation(30 * 10**12, 0.5, peak)  # 60 TFLOP/s of 100
    assert use.mfu == pytest.approx(0.6) and use.error is None
    assert use.achieved_flops_per_s == pytest.approx(60e12)
    assert use.to_json() == {"flops_per_step": 30 * 10**12, "achieved_flops_per_s": use.achieved_flops_per_s,
                             "peak_flops_per_s": 100e12, "peak_source": peak.source, "peak_precision": "bf16",
                             "mfu": use.mfu, "mfu_error": None}


@pytest.mark.parametrize(("source", "blames"), [("table: NVIDIA A100, dense bf16 (datasheet)", "the table is wrong"),
                                                ("measured: 1024x1024 float32 matmul", "measurement undershot")])
def test_utilisation_over_one_is_an_error_not_a_figure(source: str, blames: str) -> None:
    use = utilisation(13 * 10**12, 1.0, Peak(10e12, "bf16", source))
    assert use.mfu is None
    assert use.error is not None and "1.3x the peak" in use.error and blames in use.error and source in use.error


def test_utilisation_without_counted_flops_says_so() -> None:
    use = utilisation(0, 0.1, Peak(1e12, "fp32", "measured: x"))
    assert use.mfu is None and use.error is not None and "no FLOPs counted" in use.error
    with pytest.raises(ValueError, match="step_s=0"):
        utilisation(10, 0.0, Peak(1e12, "fp32", "measured: x"))


@pytest.mark.parametrize(("device", "dtype", "tf32", "precision"), [
    (CPU, torch.float32, False, "fp32"), (CPU, torch.float32, True, "fp32"), (CPU, torch.bfloat16, False, "bf16"),
    (CPU, torch.float64, False, "fp64"), (CUDA, torch.float16, True, "fp16"), (CUDA, torch.float32, True, "tf32"),
    (CUDA, torch.float32, False, "fp32"), (CUDA, torch.bfloat16, True, "bf16")])
def test_precision_of(monkeypatch: pytest.MonkeyPatch, device: torch.device, dtype: torch.dtype, tf32: bool,
                      precision: str) -> None:
    monkeypatch.setattr(flops, "_tf32_matmul", lambda: tf32)
    assert precision_of(device, dtype) == precision


def test_precision_of_reads_torchs_tf32_flag() -> None:
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has no fp32_precision API")
    before = torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        assert precision_of(CUDA, torch.float32) == "tf32"
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        assert precision_of(CUDA, torch.float32) == "fp32"
    finally:
        torch.backends.cuda.matmul.fp32_precision = before


def test_precision_of_refuses_a_dtype_without_a_matmul_peak() -> None:
    with pytest.raises(ValueError, match=r"dtype=torch.int8 .* bfloat16, float16, float32, float64"):
        precision_of(CPU, torch.int8)


@pytest.mark.gpu
def test_a_real_gpus_measured_peak_stays_under_its_datasheet() -> None:
    name = torch.cuda.get_device_name()
    table = table_peak(name, "bf16")
    if table is None:
        pytest.skip(f"{name!r} has no bf16 row in the table")
    measured = measured_peak(torch.device("cuda"), torch.bfloat16, budget_s=2.0)
    assert peak_flops(torch.device("cuda"), torch.bfloat16) == table
    # cuBLAS reaches 60-90 % of a datasheet's dense figure on large square matmuls; above it, the row is wrong
    assert 0.3 * table.flops_per_s < measured.flops_per_s <= 1.05 * table.flops_per_s, (measured, table)
