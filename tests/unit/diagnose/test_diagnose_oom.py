"""A doctored script that dies of an out-of-memory error: the report's `oom` entry, the text and the HTML say so
with advice, and what was measured before it stays in the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainfast.cli import main
from trainfast.diagnose import run_doctor
from trainfast.diagnose.capture import script as runner_module
from trainfast.diagnose.capture.observations import Observations
from trainfast.diagnose.show.html import render_html
from trainfast.oom import MemorySnapshot

GIB = 2**30
CUDA_OOM = ('torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity '
            'of 16.00 GiB of which 1.20 GiB is free.\\nIf reserved but unallocated memory is large try setting '
            'PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")')
CPU_OOM = ('RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can\'t allocate '
           'memory: you tried to allocate 1000000 bytes. Error code 12 (Cannot allocate memory)")')
OOM_KEYS = {"message", "step", "device", "allocated_bytes", "reserved_bytes", "total_bytes", "fragmented", "advice"}

# Six training steps, then the error inside the seventh step's forward pass (as an OOM usually comes).
TRAINS_THEN_FAILS = """
import torch

model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1000):
    out = model(torch.randn(8, 4))
    if step == 6:
        raise {error}
    out.sum().backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def script(tmp_path: Path, error: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text(TRAINS_THEN_FAILS.format(error=error))
    return path


def test_a_cuda_oom_after_measured_steps_keeps_the_report_and_adds_the_oom_entry(tmp_path: Path) -> None:
    run = run_doctor(str(script(tmp_path, CUDA_OOM)), steps=10, warmup=1)
    report = run.report.to_json()
    assert run.exit_code == 1 and "Traceback" in (run.error or "")  # as for any crash
    assert report["script"]["outcome"].startswith("the script crashed: OutOfMemoryError: CUDA out of memory.")
    oom = report["oom"]
    assert set(oom) == OOM_KEYS
    assert oom["message"] == ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                              "16.00 GiB of which 1.20 GiB is free.")  # the first line only
    assert oom["step"] == 7 and oom["device"] == "cpu"  # the model's device: no CUDA allocator to read
    assert oom["allocated_bytes"] is None and oom["reserved_bytes"] is None and oom["total_bytes"] is None
    assert oom["fragmented"] is False
    assert "find_batch_size" in oom["advice"] and "expandable_segments" not in oom["advice"]
    # the six steps before it were measured (one warm-up): the figures stay
    assert report["steps_measured"] == 5 and report["verdict"] is not None and report["samples_per_s"] > 0


def test_the_cli_says_the_cpu_allocator_ran_out_of_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, page = tmp_path / "report.json", tmp_path / "report.html"
    code = main(["doctor", "--warmup", "1", "--json", str(out), "--html", str(page), str(script(tmp_path, CPU_OOM))])
    assert code == 1  # a crashed script's exit code, as before
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "the script ran out of memory at step 7 on cpu: [enforce fail at alloc_cpu.cpp:127] err == 0. " \
           "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1000000 bytes" in printed
    assert "a smaller batch (trainfast.find_batch_size" in printed
    assert "RuntimeError: [enforce fail at alloc_cpu.cpp:127]" in printed  # the run line is not read as markup
    report = json.loads(out.read_text())
    assert report["oom"]["step"] == 7 and "can't allocate memory" in report["oom"]["message"]
    html = page.read_text()
    assert "The script ran out of memory at step 7 on cpu</strong>" in html and "can&#x27;t allocate memory" in html


@pytest.mark.parametrize(("reserved", "fragmented"), [(10 * GIB, True), (GIB + 2**20, False)])
def test_a_cuda_snapshot_with_cached_blocks_names_expandable_segments(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], reserved: int,
        fragmented: bool) -> None:
    seen: list[torch.device] = []

    def snapshot(device: torch.device) -> MemorySnapshot:
        seen.append(device)
        return MemorySnapshot(allocated=GIB, reserved=reserved, total=16 * GIB)
    monkeypatch.setattr(runner_module, "memory_at_oom", snapshot)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert main(["doctor", "--warmup", "1", str(script(tmp_path, CUDA_OOM))]) == 1
    printed = " ".join(capsys.readouterr().out.split())
    assert seen == [torch.device("cpu")]  # asked for the model's device
    # the paragraph (the run line above it quotes torch's whole message, its generic hint included)
    paragraph = printed[printed.index("the script ran out of memory"):printed.index("verdict:")]
    assert paragraph.startswith("the script ran out of memory at step 7 on cpu: CUDA out of memory.")
    assert "1.0 GiB allocated by tensors" in paragraph and "reserved by torch, of 16.0 GiB" in paragraph
    assert ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in paragraph) is fragmented
    run = run_doctor(str(script(tmp_path, CUDA_OOM)), steps=10, warmup=1)
    oom = run.report.to_json()["oom"]
    assert (oom["allocated_bytes"], oom["reserved_bytes"], oom["total_bytes"]) == (GIB, reserved, 16 * GIB)
    assert oom["fragmented"] is fragmented
    assert ("expandable_segments:True" in oom["advice"]) is fragmented


def test_a_script_that_fails_otherwise_has_no_oom_entry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = script(tmp_path, 'ValueError("the data ran out of unicorns")')
    assert main(["doctor", "--warmup", "1", str(path)]) == 1
    assert "out of memory" not in capsys.readouterr().out
    run = run_doctor(str(path), steps=10, warmup=1)
    assert run.exit_code == 1 and run.report.to_json()["oom"] is None
    assert "out of memory" not in render_html(run.report.to_json())


def test_an_oom_before_the_first_step_says_so(tmp_path: Path) -> None:
    path = tmp_path / "train.py"
    path.write_text(f"import torch\nraise {CUDA_OOM}\n")
    report = run_doctor(str(path), steps=10, warmup=1).report
    oom = report.to_json()["oom"]
    assert oom["step"] is None and oom["device"] is None  # no model seen, no CUDA work done
    assert report.verdict is None
    from trainfast.diagnose.show.text import oom_paragraph
    assert oom_paragraph(oom).startswith("the script ran out of memory before its first training step: CUDA out")


def test_the_allocator_is_read_on_the_models_device() -> None:
    assert runner_module.model_device(Observations(device="cuda", device_index=1)) == torch.device("cuda", 1)
    assert runner_module.model_device(Observations(device="cpu")) == torch.device("cpu")
    if not torch.cuda.is_initialized():  # no model seen: the current CUDA device only after CUDA work
        assert runner_module.model_device(Observations()) is None


def test_the_html_oom_block_is_escaped_and_tolerates_odd_entries() -> None:
    page = render_html({"oom": {"message": "<script>x</script>", "step": 3, "device": "cuda:0", "advice": "b<i>"}})
    expected = ("The script ran out of memory at step 3 on cuda:0</strong>: &lt;script&gt;x&lt;/script&gt;. "
                "b&lt;i&gt;.</p>")
    assert expected in page
    assert "ran out of memory" not in render_html({"oom": "odd"})
    assert "ran out of memory before its first training step" in render_html({"oom": {}})
