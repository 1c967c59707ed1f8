"""How far compute is from the peak: the doctor counts one whole step's FLOPs (after the measured ones) and puts
the rate it achieved against the peak at the run's precision (measured on a CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from trainfast.diagnose import run_doctor
from trainfast.diagnose.records.findings import Verdict
from trainfast.diagnose.show.text import compute_line
from trainfast.diagnose.verdict import with_peak

LOOP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
for _ in range(200):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_compute_bound_loop_gets_its_flops_and_mfu_against_a_measured_cpu_peak(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    report = run_doctor(str(script), steps=8, warmup=2).report
    compute = report.to_json()["compute"]
    # forward 2*64*(256*512 + 512*10) FLOPs, backward twice that (input and weight gradients; the first layer's
    # input gradient is not needed, which torch skips: 2/3 of a full backward for that layer)
    forward = 2 * 64 * (256 * 512 + 512 * 10)
    assert forward * 2 <= compute["flops_per_step"] <= forward * 3, compute
    assert compute["peak_source"].startswith("measured:") and "float32" in compute["peak_source"]
    assert compute["peak_precision"] == "fp32" and compute["achieved_flops_per_s"] > 0
    assert (compute["mfu"] is not None and 0 < compute["mfu"] <= 1) or compute["mfu_error"], compute
    assert report.steps and len(report.steps) == 8  # the counted step is not among the measured
    console = Console(record=True, width=200)
    report.render(console)
    text = console.export_text()
    assert "GFLOP per step" in text and "MFU" in text


@pytest.mark.torch_compile
@pytest.mark.slow
def test_a_compiled_model_is_not_counted_and_says_why(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(LOOP.replace("opt = ", "model = torch.compile(model)\nopt = "))
    report = run_doctor(str(script), steps=3, warmup=3).report
    compute = report.to_json()["compute"]
    assert compute["flops_per_step"] is None and "compiled" in compute["reason"]
    assert "FLOPs not counted" in compute_line(compute)


@pytest.mark.parametrize(("mfu", "says"), [(0.8, "near the hardware's limit"), (0.05, "far below the peak"),
                                           (0.3, "between the two")])
def test_a_compute_bound_verdict_says_how_far_from_the_peak(mfu: float, says: str) -> None:
    compute = {"mfu": mfu, "peak_source": "table: NVIDIA H100 SXM, dense bf16", "peak_precision": "bf16"}
    verdict = with_peak(Verdict("compute-bound", "the GPU takes 95% of each step"), compute)
    assert says in verdict.reason and f"{mfu:.0%} of a datasheet's bf16 peak" in verdict.reason
    assert with_peak(Verdict("input-bound", "x"), compute).reason == "x"  # only compute-bound needs it
    over = {"mfu": None, "mfu_error": "achieved 1.3x the peak: the table is wrong", "flops_per_step": 10,
            "achieved_flops_per_s": 1e12, "peak_flops_per_s": 1e12, "peak_source": "table"}
    assert with_peak(Verdict("compute-bound", "y"), over).reason == "y"  # an MFU over 1 is never a fact
    assert "MFU not reported: achieved 1.3x" in compute_line(over)
