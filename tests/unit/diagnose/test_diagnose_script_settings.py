"""The doctor reads `torch.backends.cudnn.benchmark` as the script set it while its steps were measured, not as
torch_settings() puts it back once the script is done: a script that turned it on is not told to turn it on."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from trainfast.diagnose import run_doctor
from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.fixes import recommend
from trainfast.diagnose.records.steps import Fractions

SCRIPT = textwrap.dedent("""
    import torch
    from torch import nn

    def train():
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(40):
            loss = model(torch.randn(4, 3, 8, 8)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    if __name__ == "__main__":
        {body}
""")
BODIES = {
    "never set": "train()",
    "set": "torch.backends.cudnn.benchmark = True\n    train()",
    # a polite script (or a library's context manager) puts it back on the way out, which the doctor's stop takes
    "set, put back on exit": ("torch.backends.cudnn.benchmark = True\n    try:\n        train()\n    finally:\n"
                              "        torch.backends.cudnn.benchmark = False"),
}


@pytest.mark.parametrize(("body", "expected"), [("never set", False), ("set", True), ("set, put back on exit", True)])
def test_the_report_has_the_scripts_cudnn_benchmark(body: str, expected: bool, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(body=BODIES[body]))
    before = torch.backends.cudnn.benchmark
    run = run_doctor(str(script), steps=5, warmup=1, probe_gains=False)
    report = run.report.to_json()
    assert run.exit_code == 0 and report["steps_measured"] == 5, report["script"]
    assert report["observed"]["cudnn_benchmark"] is expected
    assert report["observed"]["conv_weights"] == 1
    assert torch.backends.cudnn.benchmark is before  # put back after the report


@pytest.mark.parametrize(("benchmark", "recommended"), [(False, True), (True, False)])
def test_the_rule_follows_the_evidence(benchmark: bool, recommended: bool) -> None:
    """On a GPU (not here) the same observed value decides the rule."""
    evidence = Evidence(verdict="compute-bound", device="cuda", fractions=Fractions.of(total_s=1.0, wait_s=0.0,
                        transfer_s=0.0, host_s=0.0), step_s=0.1, steps=10, samples_per_s=100.0, syncs_per_step=0.0,
                        cpus=2, conv_weights=3, cudnn_benchmark=benchmark)
    assert ("cudnn_benchmark" in {r.id for r in recommend(evidence)}) is recommended
