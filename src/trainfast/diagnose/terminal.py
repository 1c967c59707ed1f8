"""The doctor's report in the terminal: the verdict, the step's split, the loaders, the fixes and the notes."""

from __future__ import annotations

from typing import Any, Protocol

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from trainfast.diagnose.classify import Fractions, Verdict, no_verdict_reason
from trainfast.diagnose.evidence import LoaderStats
from trainfast.diagnose.recommend import Recommendation
from trainfast.diagnose.timeline import StepRecord

VERDICT_STYLE = {"input-bound": "bold red", "transfer-bound": "bold red", "host-bound": "bold yellow",
                 "compute-bound": "bold green", "balanced": "bold cyan"}


class Shown(Protocol):
    """What of a `Report` the terminal shows (report.py's `Report.render` calls `render_terminal` with itself)."""

    script: dict[str, Any]
    oom: dict[str, Any] | None
    verdict: Verdict | None
    fractions: Fractions | None
    seen: dict[str, int]
    warmup_steps: int
    samples_per_s: float | None
    step_spread: dict[str, float] | None
    step_signal: str | None
    steps: list[StepRecord]
    compute: dict[str, Any] | None
    loaders: list[LoaderStats]
    recommendations: list[Recommendation]
    verify: dict[str, Any] | None
    env: dict[str, Any]
    notes: list[str]


def render_terminal(report: Shown, console: Console | None = None) -> None:
    """`report` on `console` (a new one by default)."""
    console = console or Console()
    title = "trainfast doctor" + (f" — {report.script['target']}" if report.script.get("target") else "")
    console.rule(title)
    if report.script.get("outcome"):
        console.print(f"run: {escape(str(report.script['outcome']))}")  # the script's error text: not markup
    if report.oom:
        console.print(f"[bold red]{escape(oom_headline(report.oom))}[/]: "
                      f"{escape(oom_paragraph(report.oom, headline=False))}")
    if report.verdict is None or report.fractions is None:
        console.print(f"[bold]verdict: n/a[/] — {no_verdict_reason(report.seen, report.warmup_steps)}")
    else:
        style = VERDICT_STYLE.get(report.verdict.name, "bold")
        console.print(f"verdict: [{style}]{report.verdict.name.upper()}[/] — {report.verdict.reason}")
        rate = f"{report.samples_per_s:,.0f} samples/s, " if report.samples_per_s else ""
        spread = report.step_spread or {}
        steps_by = {"optimizer": "a step = one iteration's optimizer step(s)",
                    "backward": "a step = one iteration's backward pass(es), no optimizer seen",
                    "explicit": "steps ended by the caller"}.get(report.step_signal or "", "")
        console.print(f"measured {len(report.steps)} steps after {report.warmup_steps} warm-up ({steps_by}): {rate}"
                      f"step p10/p50/p90 {1e3 * spread.get('p10', 0):.1f}/{1e3 * spread.get('p50', 0):.1f}/"
                      f"{1e3 * spread.get('p90', 0):.1f} ms")
        console.print(_split_bar(report.fractions))
        if report.compute:
            console.print(escape(compute_line(report.compute)))
    if report.loaders:
        table = Table(title="loaders", title_justify="left")
        for column in ("#", "kind", "dataset", "workers", "pin", "persistent", "prefetch", "batches", "wait"):
            table.add_column(column)
        for s in report.loaders:
            table.add_row(str(s.index), s.kind, s.dataset, str(s.num_workers), str(s.pin_memory),
                          str(s.persistent_workers), str(s.prefetch_factor), str(s.batches), f"{s.wait_s:.2f} s")
        console.print(table)
    if report.recommendations:
        verified = report.verify is not None
        title = ("fixes, verified gains first" if verified else "fixes, measured gains first, then estimates")
        table = Table(title=title, title_justify="left", show_lines=True)
        for column in ("id", "expected", *(("verified",) if verified else ()), "fix"):
            table.add_column(column, overflow="fold")
        for r in report.recommendations:
            basis = "measured" if r.gain_basis != "estimate" else "estimate"  # (verified: its own column)
            expected = f"{r.expected_gain:.2f}x\n{basis}" if r.expected_gain else f"?\n{basis}"
            measured = (f"{r.measured_gain:.2f}x" if r.measured_gain is not None else "-",) if verified else ()
            estimate = f"\nan estimate: {r.basis_reason}" if r.gain_basis == "estimate" and r.basis_reason else ""
            table.add_row(r.id, expected, *measured,
                          f"[bold]{r.title}[/]\nwhy: {r.why}{estimate}\nfix: [cyan]{r.fix}[/]")
        console.print(table)
    elif report.verdict is not None:
        console.print("no fix to recommend from what was measured")
    for check in report.env.get("checks", []):
        if check.get("status") in ("warn", "fail"):
            console.print(f"[yellow]{check['status']}[/] {check['name']}: {check['detail']} — {check.get('fix', '')}")
    for note in report.notes:
        console.print(f"note: {note}")


def compute_line(compute: dict[str, Any]) -> str:
    """The `compute` entry in words: FLOPs per step, the rate achieved and how far it is from the peak."""
    flops = compute.get("flops_per_step")
    if flops is None or compute.get("achieved_flops_per_s") is None:
        return f"compute: FLOPs not counted ({compute.get('reason') or 'unknown'})"
    head = (f"compute: {flops / 1e9:,.2f} GFLOP per step, {compute['achieved_flops_per_s'] / 1e9:,.1f} GFLOP/s "
            f"achieved; peak {compute['peak_flops_per_s'] / 1e9:,.0f} GFLOP/s ({compute['peak_source']})")
    if compute.get("mfu") is None:
        return f"{head}; MFU not reported: {compute.get('mfu_error')}"
    return f"{head}: MFU {compute['mfu']:.1%}"


def oom_headline(oom: dict[str, Any]) -> str:
    """Where the script ran out of memory (the `oom` entry's step and device)."""
    step = oom.get("step")
    where = f"at step {step}" if step is not None else "before its first training step"
    return f"the script ran out of memory {where}" + (f" on {oom['device']}" if oom.get("device") else "")


def oom_paragraph(oom: dict[str, Any], *, headline: bool = True) -> str:
    """The `oom` entry in words: where, the error's first line, what the allocator held and what to change."""
    parts = (str(oom.get("message") or "out of memory"), str(oom.get("advice") or ""))
    detail = " ".join(f"{part.rstrip('.')}." for part in parts if part)
    return f"{oom_headline(oom)}: {detail}" if headline else detail


def _split_bar(f: Fractions, width: int = 60) -> str:
    parts = [("data wait", f.data_wait, "red"), ("transfer", f.transfer, "magenta"), ("host", f.host, "yellow"),
             *((("rollout / host work between updates", f.collection, "blue"),) if f.collection else ()),
             ("compute", f.compute, "green")]
    bar = "".join(f"[{color}]{'█' * round(share * width)}[/]" for _, share, color in parts)
    legend = "  ".join(f"[{color}]■[/] {name} {share:.0%}" for name, share, color in parts)
    return f"{bar}\n{legend}"
