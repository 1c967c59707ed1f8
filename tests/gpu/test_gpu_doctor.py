"""`trainfast doctor` on four small GPU scripts, one per verdict, and on the same transfer-bound script with
its batch in pageable and in page-locked memory (tests/gpu/scripts/). Each run is a subprocess:
`python -m trainfast doctor --warmup W --steps N --max-seconds S --json PATH SCRIPT [-- ARGS]`.

What makes each verdict (diagnose/classify.py): a part (data wait, transfer, host) is the limit at >= 25 % of
the step; "compute-bound" needs every part under 15 %. The scripts are built so that the intended part is most
of the step by a wide margin, on any current GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from statistics import fmean
from typing import Any

import pytest

Doctor = Callable[..., dict[str, Any]]


def check_measured(report: dict[str, Any]) -> None:
    assert report["verdict"] is not None and report["steps_measured"] >= 5, report["_explain"]
    assert report["observed"]["device"] == "cuda", report["_explain"]


@pytest.mark.gpu
def test_slow_getitem_is_input_bound(doctor: Doctor) -> None:
    report = doctor("input_bound.py")
    check_measured(report)
    assert report["verdict"] == "input-bound", report["_explain"]
    assert report["data_wait_fraction"] > 0.5, report["_explain"]


@pytest.mark.gpu
def test_large_pageable_copies_are_transfer_bound(doctor: Doctor) -> None:
    report = doctor("transfer_bound.py")
    check_measured(report)
    assert report["verdict"] == "transfer-bound", report["_explain"]


@pytest.mark.gpu
def test_tiny_kernels_and_item_each_step_are_host_bound(doctor: Doctor) -> None:
    report = doctor("host_bound.py")
    check_measured(report)
    assert report["verdict"] == "host-bound", report["_explain"]


@pytest.mark.gpu
def test_large_matmuls_on_gpu_inputs_are_compute_bound(doctor: Doctor) -> None:
    # More warm-up steps than the others: the GPU is busy during them too, which keeps a GPU utilisation read
    # over the whole run (start-up included) well above the doctor's "starved GPU" bar.
    report = doctor("compute_bound.py", warmup=8, steps=25)
    check_measured(report)
    assert report["verdict"] == "compute-bound", report["_explain"]
    # how far from the peak: a whole step's FLOPs against the datasheet's dense figure (or, for a GPU the table
    # lacks, a measured matmul peak), never an MFU over 1
    compute = report["compute"]
    assert compute["flops_per_step"] and compute["flops_per_step"] > 0, compute
    assert compute["peak_source"].startswith(("table:", "measured:")), compute
    assert (compute["mfu"] is not None and 0 < compute["mfu"] <= 1) or compute["mfu_error"], compute
    # mixed precision was timed on the model itself, not assumed
    amp = [r for r in report["recommendations"] if r["id"] == "amp"]
    assert all(r["gain_basis"] == "measured" for r in amp), amp


def transfer_s_per_step(report: dict[str, Any]) -> float:
    return fmean(step["transfer_s"] for step in report["timeline"])


@pytest.mark.gpu
def test_pinned_copies_spend_less_time_in_transfer_than_pageable(doctor: Doctor) -> None:
    pageable = doctor("transfer_bound.py")  # the run of the transfer-bound test, when it ran first
    pinned = doctor("transfer_bound.py", "--pin")
    check_measured(pageable)
    check_measured(pinned)
    figures = (f"pageable: {transfer_s_per_step(pageable) * 1e3:.3f} ms/step, fractions {pageable['fractions']}; "
               f"pinned: {transfer_s_per_step(pinned) * 1e3:.3f} ms/step, fractions {pinned['fractions']}")
    assert transfer_s_per_step(pageable) > 0, figures
    assert transfer_s_per_step(pinned) < transfer_s_per_step(pageable), figures
    assert pinned["fractions"]["transfer"] < pageable["fractions"]["transfer"], figures
    # the pageable run's advice includes pinning
    assert "pin_memory" in {r["id"] for r in pageable["recommendations"]}, pageable["recommendations"]
