"""The doctor's report in the terminal: the verdict, the step's split, the loaders, the fixes and the notes."""

from __future__ import annotations

from typing import Any, Protocol

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from trainfast.diagnose.attempts import lost_progress_line
from trainfast.diagnose.classify import Fractions, Verdict, no_verdict_reason
from trainfast.diagnose.evidence import LoaderStats
from trainfast.diagnose.recommendation import Recommendation
from trainfast.diagnose.timeline import StepRecord

VERDICT_STYLE = {"input-bound": "bold red", "transfer-bound": "bold red", "host-bound": "bold yellow",
                 "communication-bound": "bold magenta", "compute-bound": "bold green", "balanced": "bold cyan"}


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
    whole_run: dict[str, Any] | None


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
    if report.whole_run is not None:
        render_whole_run(report.whole_run, console)
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
        whole = report.whole_run is not None
        title = ("fixes, verified gains first" if verified else "fixes, measured gains first, then estimates")
        if whole:
            title = "fixes for the whole run, ranked by their gain on its wall time"
        table = Table(title=title, title_justify="left", show_lines=True)
        for column in ("id", *(("run gain",) if whole else ()), "expected", *(("verified",) if verified else ()),
                       "fix"):
            table.add_column(column, overflow="fold")
        for r in report.recommendations:
            basis = "measured" if r.gain_basis != "estimate" else "estimate"  # (verified: its own column)
            expected = f"{r.expected_gain:.2f}x\n{basis}" if r.expected_gain else f"?\n{basis}"
            run = (f"{r.run_gain:.2f}x" if r.run_gain else "-",) if whole else ()
            measured = (f"{r.measured_gain:.2f}x" if r.measured_gain is not None else "-",) if verified else ()
            estimate = f"\nan estimate: {r.basis_reason}" if r.gain_basis == "estimate" and r.basis_reason else ""
            fix = f"\nfix: [cyan]{escape(r.fix)}[/]" if r.fix else ""
            table.add_row(r.id, *run, expected, *measured, f"[bold]{r.title}[/]\nwhy: {r.why}{estimate}{fix}")
        console.print(table)
    elif report.verdict is not None:
        console.print("no fix to recommend from what was measured")
    for check in report.env.get("checks", []):
        if check.get("status") in ("warn", "fail"):
            console.print(f"[yellow]{check['status']}[/] {check['name']}: {escape(str(check['detail']))} — "
                          f"{escape(str(check.get('fix', '')))}")
    for note in report.notes:
        console.print(f"note: {escape(note)}")


PHASE_STYLE = {"startup": "blue", "compile": "magenta", "train": "green", "evaluation": "cyan",
               "checkpoint": "yellow", "epoch_start": "red", "other": "white"}
SPARKS = "▁▂▃▄▅▆▇█"


def render_whole_run(whole: dict[str, Any], console: Console) -> None:
    """The `whole_run` entry: the phases with their seconds and shares, the train split, throughput over time and
    drift, what evaluation and the checkpoint writes were."""
    doctor = f" (the doctor's own {whole['doctor_s']:.1f} s left out)" if whole.get("doctor_s") else ""
    console.print(f"[bold]whole run[/]: {whole['wall_s']:.1f} s{doctor} — goodput [bold]{whole['goodput']:.0%}[/] "
                  "(the share of the wall time in training steps)")
    table = Table(title_justify="left")
    for column in ("phase", "seconds", "share", ""):
        table.add_column(column)
    for p in whole["phases"]:
        color = PHASE_STYLE[p["phase"]]
        table.add_row(p["phase"], f"{p['seconds']:.2f}", f"{p['share']:.1%}",
                      f"[{color}]{'█' * round(40 * p['share'])}[/]")
    console.print(table)
    train = whole["train"]
    if train["steps"]:
        seconds = max(train["seconds"], 1e-9)
        rate = f"{train['samples_per_s']:,.0f} samples/s over their own time; " if train["samples_per_s"] else ""
        console.print(f"train: {train['steps']} steps, {rate}data wait {train['data_wait_s'] / seconds:.0%}, "
                      f"transfer {train['transfer_s'] / seconds:.0%}, host {train['host_s'] / seconds:.0%}, "
                      f"compute {train['compute_s'] / seconds:.0%}")
    rates = [t["samples_per_s"] for t in whole["throughput"] if t["samples_per_s"]]
    if rates:
        low, high = min(rates), max(rates)
        spark = "".join(SPARKS[min(7, int(8 * (r - low) / (high - low)))] if high > low else SPARKS[4] for r in rates)
        console.print(f"throughput over time ({len(rates)} intervals): {spark}  {low:,.0f}-{high:,.0f} samples/s")
    drift = whole["drift"]
    style = "bold red" if drift.get("drifted") else "dim"
    console.print(f"drift: [{style}]{escape(drift['reason'])}[/]")
    other = whole["other"]
    if other["logging_s"] or other["sleep_s"]:
        console.print(f"other: printing/logging {other['logging_s']:.2f} s, sleeping {other['sleep_s']:.2f} s, host "
                      f"work between phases {other['host_s']:.2f} s")
    evaluation = whole["evaluation"]
    if evaluation["passes"]:
        precision = ("under autocast" if evaluation["autocast_forwards"] == evaluation["forwards"] else
                     "in the model's own precision (no autocast)" if not evaluation["autocast_forwards"] else
                     "partly under autocast")
        console.print(f"evaluation: {evaluation['passes']} pass(es), {evaluation['forwards']} forward(s) {precision}, "
                      f"data wait {evaluation['data_wait_s']:.2f} s")
    checkpoint = whole["checkpoint"]
    if checkpoint["count"]:
        rate = (f", {checkpoint['bytes'] / 1e6 / checkpoint['seconds']:,.0f} MB/s" if checkpoint["bytes"]
                and checkpoint["seconds"] > 0 else "")
        console.print(f"checkpoint: {checkpoint['count']} write(s), {checkpoint['bytes'] / 1e6:,.1f} MB in "
                      f"{checkpoint['seconds']:.2f} s{rate}; training blocked {checkpoint['blocking_s']:.2f} s")
    lost = whole.get("lost_progress")
    if lost:
        console.print(f"[bold red]lost progress[/]: {escape(lost_progress_line(lost))}")


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
             *((("communication", f.communication, "cyan"),) if f.communication else ()),
             ("compute", f.compute, "green")]
    bar = "".join(f"[{color}]{'█' * round(share * width)}[/]" for _, share, color in parts)
    legend = "  ".join(f"[{color}]■[/] {name} {share:.0%}" for name, share, color in parts)
    return f"{bar}\n{legend}"
