"""`--verify` injects the model fixes into an unmodified script and measures them (capture/inject_model.py): the
shape of timm's train.py (tests/integration/scripts/task_wrapper_amp.py: the model inside a task wrapper that refuses
`.to(memory_format=...)`) re-run with channels_last, bf16 autocast and torch.compile, each between two baselines;
those verified faster then measured together; and a compile that fails falls back to eager, with the reason as the
fix's, never a figure that is eager's."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.report.verify import verify_fixes
from trainfast.diagnose.report.verify_gains import kept
from trainfast.diagnose.report.verify_runs import child_env, run_child

SCRIPT = Path(__file__).parent / "scripts" / "task_wrapper_amp.py"
SMALL = ["--threads", "1", "--image-size", "16", "--width", "16", "--batch-size", "8", "--accum", "1"]

pytestmark = [pytest.mark.slow, pytest.mark.torch_compile]


def _fix(fix_id: str, overrides: dict[str, object]) -> Recommendation:
    return Recommendation(fix_id, fix_id, "why", "fix", None, overrides=overrides)


def test_channels_last_bf16_and_compile_are_injected_into_the_unmodified_script_and_measured() -> None:
    fixes = [_fix("channels_last", {"memory_format": "channels_last"}), _fix("amp", {"autocast": "bfloat16"}),
             _fix("compile", {"compile": True})]
    ranked, info = verify_fixes(str(SCRIPT), args=SMALL, recommendations=fixes, steps=4, warmup=3,
                                max_seconds=120)
    for fix_id in ("channels_last", "amp", "compile"):
        gain = info["gains"][fix_id]
        assert gain["error"] is None and gain["median"] is not None, info["runs"]
    runs = {run["fix"]: run for run in info["runs"]}
    assert runs["channels_last"]["events"][0].startswith("the model trained (Task, ")  # the wrapper, found
    assert "channels_last (3 4-D weight(s)" in runs["channels_last"]["events"][0]  # its .to() refused: each tensor
    assert "bfloat16 autocast around its training forwards" in runs["amp"]["events"][0]
    assert runs["compile"]["events"] == [runs["compile"]["events"][0]]  # compiled, no fall-back
    assert all(r.gain_basis == "verified" for r in ranked)
    # float rounding (bf16, a compiled step, a layout) is no change of what is learned: the loss stays within the
    # baselines' spread
    assert all(g["trains_same"] is True for g in info["gains"].values()), info["gains"]
    faster = sorted(i for i, g in info["gains"].items() if kept(g))
    if faster:  # what this machine decided faster alone (and training the same), measured together
        together = info["set"]
        assert sorted(together["ids"]) == faster and together["median"] is not None, together
        assert len(faster) == 1 or [r["fix"] for r in info["runs"]][-2:] == ["set", "baseline"]
    else:
        assert info["set"] is None


def test_a_compile_that_fails_falls_back_and_the_fix_says_why_instead_of_a_figure(tmp_path: Path) -> None:
    """One run of the fix is enough to see it (its baselines would only add a figure it does not get)."""
    spec = {"target": str(SCRIPT), "module": False, "args": [*SMALL, "--no-compiler"], "steps": 3, "warmup": 1,
            "max_seconds": 120}
    run = run_child("compile", {"compile": True}, spec, workdir=tmp_path, name="run001", env=child_env(),
                    cwd=str(tmp_path), timeout_s=180)
    assert run["exit_code"] == 0 and run["samples_per_s"]  # the script itself ran on, eagerly
    assert run["error"].startswith("torch.compile fell back to eager: ") and "compiler" in run["error"].lower(), run
    assert run["events"][-1] == run["error"]


def test_a_whole_runs_evaluation_and_checkpoint_fixes_are_injected_and_measured_over_the_runs_wall_time() -> None:
    """A whole run's fixes show in its wall time, not in its steps: each run goes to the script's end (its
    fp32 evaluation every 10 steps, a torch.save every 10), and a fix's figure is the samples over that wall time."""
    script = Path(__file__).parent / "scripts" / "whole_run_loop.py"
    fixes = [_fix("eval_autocast", {"eval_autocast": "bfloat16"}), _fix("async_checkpoint", {"async_checkpoint": True})]
    _, info = verify_fixes(str(script), args=["--epochs", "1", "--samples", "640", "--width", "64", "--eval-every",
                                              "10", "--save-every", "10", "--workers", "0"],
                           recommendations=fixes, steps=3, warmup=1, max_seconds=120, whole_run=True)
    assert info["whole_run"] and all(g["median"] is not None for g in info["gains"].values()), info["runs"]
    runs = {run["fix"]: run for run in info["runs"]}
    assert "inference_mode + bfloat16 autocast around its evaluation forwards" in runs["eval_autocast"]["events"][0]
    assert any("torch.save call(s) written in the background" in event
               for event in runs["async_checkpoint"]["events"]), runs["async_checkpoint"]
    # the figure is the samples over the script's own wall time, which leaves out what the run's seconds hold too:
    # the child's interpreter start, torch's import and the doctor's report
    assert 640 / runs["baseline"]["seconds"] < runs["baseline"]["samples_per_s"]
