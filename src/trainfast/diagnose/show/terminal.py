"""The doctor's report in the terminal: the verdict, the step's split, the loaders, the fixes and the notes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from trainfast.diagnose.report.job import PHASE_WORDS, STRAGGLER_SHARE, _ms, job_collectives
from trainfast.diagnose.report.verify import set_line
from trainfast.diagnose.report.verify_gains import verified_cell
from trainfast.diagnose.show.look import NO_VERDICT, PARTS, PHASE_COLOURS, VERDICTS
from trainfast.diagnose.show.text import (
    compute_line,
    gain,
    lost_progress_line,
    oom_headline,
    oom_paragraph,
    where_line,
)
from trainfast.trainer.phases import PHASES


def render_terminal(report: Mapping[str, Any], console: Console | None = None) -> None:
    """The report (its JSON: `Report.to_json()`, the one representation the displays read) on `console` (a new one by
    default)."""
    console = console or Console()
    script = report.get("script") or {}
    title = "trainfast doctor" + (f" — {script['target']}" if script.get("target") else "")
    console.rule(title)
    if script.get("outcome"):
        console.print(f"run: {escape(str(script['outcome']))}")  # the script's error text: not markup
    if report.get("oom"):
        console.print(f"[bold red]{escape(oom_headline(report['oom']))}[/]: "
                      f"{escape(oom_paragraph(report['oom'], headline=False))}")
    verdict, fractions = report.get("verdict"), report.get("fractions")
    if verdict is None or fractions is None:
        console.print(f"[bold]verdict: n/a[/] — {report.get('verdict_reason')}")
    else:
        style = VERDICTS.get(verdict, NO_VERDICT)[0]
        console.print(f"verdict: [{style}]{verdict.upper()}[/] — {report.get('verdict_reason')}")
        rate = f"{report['samples_per_s']:,.0f} samples/s, " if report.get("samples_per_s") else ""
        spread = report.get("step_s_percentiles") or {}
        steps_by = {"optimizer": "a step = one iteration's optimizer step(s)",
                    "backward": "a step = one iteration's backward pass(es), no optimizer seen",
                    "explicit": "steps ended by the caller"}.get(report.get("step_signal") or "", "")
        console.print(f"measured {report.get('steps_measured')} steps after {report.get('warmup_steps')} warm-up "
                      f"({steps_by}): {rate}step p10/p50/p90 {1e3 * spread.get('p10', 0):.1f}/"
                      f"{1e3 * spread.get('p50', 0):.1f}/{1e3 * spread.get('p90', 0):.1f} ms")
        console.print(_split_bar(fractions))
        if report.get("compute"):
            console.print(escape(compute_line(report["compute"])))
    if report.get("whole_run") is not None:
        render_whole_run(report["whole_run"], console)
    if report.get("loaders"):
        table = Table(title="loaders", title_justify="left")
        for column in ("#", "kind", "dataset", "workers", "pin", "persistent", "prefetch", "batches", "wait"):
            table.add_column(column)
        for s in report["loaders"]:
            table.add_row(str(s["index"]), s["kind"], s["dataset"], str(s["num_workers"]), str(s["pin_memory"]),
                          str(s["persistent_workers"]), str(s["prefetch_factor"]), str(s["batches"]),
                          f"{s['wait_s']:.2f} s")
        console.print(table)
    if report.get("recommendations"):
        console.print(_fixes(report))
        together = (report.get("verify") or {}).get("set")
        if together:
            console.print(f"verified {escape(set_line(together))}")
    elif verdict is not None:
        console.print("no fix to recommend from what was measured")
    for check in (report.get("env") or {}).get("checks", []):
        if check.get("status") in ("warn", "fail"):
            console.print(f"[yellow]{check['status']}[/] {check['name']}: {escape(str(check['detail']))} — "
                          f"{escape(str(check.get('fix', '')))}")
    for note in report.get("notes") or []:
        console.print(f"note: {escape(note)}")
    if report.get("ranks") is not None:  # a torchrun job's report
        render_ranks(report, console)


def _fixes(report: Mapping[str, Any]) -> Table:
    """The fixes, ranked: the gain on the step (its basis), on a whole run's wall time, and as verified."""
    verified = report.get("verify") is not None
    whole = report.get("whole_run") is not None
    title = ("fixes, verified gains first" if verified else "fixes, measured gains first, then estimates")
    if whole:
        title = "fixes for the whole run, ranked by their gain on its wall time"
    table = Table(title=title, title_justify="left", show_lines=True)
    for column in ("id", *(("run gain",) if whole else ()), "expected", *(("verified",) if verified else ()), "fix"):
        table.add_column(column, overflow="fold")
    for r in report["recommendations"]:
        basis = "measured" if r["gain_basis"] != "estimate" else "estimate"  # (verified: its own column)
        expected = f"{gain(r['expected_gain'])}\n{basis}" if r["expected_gain"] else f"?\n{basis}"
        run = (gain(r["run_gain"]) if r["run_gain"] else "-",) if whole else ()
        measured = (_verified(report, r),) if verified else ()
        reason = r.get("gain_basis_reason")
        estimate = f"\nan estimate: {reason}" if r["gain_basis"] == "estimate" and reason else ""
        fix = f"\nfix: [cyan]{escape(r['fix'])}[/]" if r["fix"] else ""
        where = f"\n{escape(where_line(r['where']))}" if r.get("where") else ""
        unverified = verify_error(report, r["id"]) if verified and r["measured_gain"] is None else None
        fix += f"\nnot verified: {escape(unverified)}" if unverified else ""
        differs = _gain_of(report, r["id"]).get("trains_differently") if verified else None
        fix += f"\n[yellow]trains differently[/]: {escape(differs)}" if differs else ""
        table.add_row(r["id"], *run, expected, *measured,
                      f"[bold]{r['title']}[/]\nwhy: {r['why']}{estimate}{fix}{where}")
    return table


def verify_error(report: Mapping[str, Any], fix_id: str) -> str | None:
    """Why --verify has no figure for a fix it tried (a failed run, a compile that fell back), or None."""
    return _gain_of(report, fix_id).get("error")


def _gain_of(report: Mapping[str, Any], fix_id: str) -> Mapping[str, Any]:
    return ((report.get("verify") or {}).get("gains") or {}).get(fix_id) or {}


def _verified(report: Mapping[str, Any], r: Mapping[str, Any]) -> str:
    """The "verified" cell: the ratio, its interval, the decision and how it trains (report/verify_gains.py)."""
    cell = verified_cell(_gain_of(report, r["id"]))
    if cell:
        return "\n".join(cell)
    return gain(r["measured_gain"]) if r["measured_gain"] is not None else "-"


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
        color = PHASE_COLOURS[p["phase"]][0]
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


def _split_bar(fractions: Mapping[str, float], width: int = 60) -> str:
    """The step's parts as a bar of `width` blocks, and their legend (a collection phase and communication only
    where the step has them)."""
    parts = [(label, fractions.get(key, 0.0), colour) for key, _, label, colour, _ in PARTS
             if key not in ("collection", "communication") or fractions.get(key)]
    bar = "".join(f"[{color}]{'█' * round(share * width)}[/]" for _, share, color in parts)
    legend = "  ".join(f"[{color}]■[/] {name} {share:.0%}" for name, share, color in parts)
    return f"{bar}\n{legend}"


def render_ranks(report: Mapping[str, Any], console: Console) -> None:
    """The job's lines in the terminal: its samples/s over the ranks, a row per rank and the straggler."""
    rows = report.get("ranks") or []
    if report.get("samples_per_s") is not None:
        console.print(f"job: {report['samples_per_s']:,.0f} samples/s over {report['world_size']} ranks (each rank "
                      "trains its own batches: the sum of the ranks' rates)")
    else:
        console.print(f"job: samples/s over {report['world_size']} ranks unknown (see the notes)")
    # two-line headers: the table fits 80 columns
    collectives = job_collectives(rows)
    table = Table(title=f"ranks: each one's own split; its wait for the others in {collectives} is within its "
                        "comm (exposed communication) or compute",
                  title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  collapse_padding=True)
    for column in ("rank", "samples\n/s", "step\np50", "data\nwait", "transfer", "host", "comm", "compute",
                   "waiting\nfor ranks", "verdict\nalone"):
        table.add_column(column, justify="left" if column in ("rank", "verdict\nalone") else "right", no_wrap=True)
    for row in rows:
        fractions = row.get("fractions") or {}
        rate, step_s, waiting_s = row.get("samples_per_s"), row.get("step_s"), row.get("waiting_for_ranks_s")
        table.add_row(str(row["rank"]), f"{rate:,.0f}" if rate is not None else "n/a",
                      _ms(step_s) if step_s is not None else "n/a",
                      *(_share(fractions.get(p, 0.0 if p == "communication" else None))
                        for p in ("data_wait", "transfer", "host", "communication", "compute")),
                      f"{_ms(waiting_s)} ({_share(row.get('waiting_for_ranks'))})" if waiting_s is not None else "n/a",
                      escape(str(row.get("verdict") or "n/a").removesuffix("-bound").replace("communication", "comm")))
    console.print(table)
    timed = [row for row in rows if row.get("collectives")]
    if timed:
        each = ", ".join(f"rank {row['rank']} {_ms(float(row.get('communication_s') or 0.0))}" + (
            f" of {_ms(float(row['communication_total_s']))} in all" if row.get("communication_total_s") is not None
            else "") for row in timed)
        console.print(f"communication: {collectives}; blocked in them per step (exposed): {each}")
        ddp = [(row["rank"], row["ddp_all_reduce"]) for row in timed if row.get("ddp_all_reduce")]
        if ddp:
            console.print("DDP's all-reduce, by its own timers (" + ("its sampled iterations in the window" if all(
                d["in_window"] for _, d in ddp) else "its sampled iterations, the first 10 and every 100th") +
                "): " + ", ".join(f"rank {r} {_ms(d['seconds_per_iteration'])} an iteration in all, "
                                  f"{_ms(d['overlapped_s_per_iteration'])} of it overlapped with the backward"
                                  for r, d in ddp))
    if any(row.get("whole_run") for row in rows):
        phases = PHASES
        whole = Table(title="ranks' whole runs: seconds in each phase", title_justify="left", box=box.SIMPLE_HEAD,
                      show_edge=False, pad_edge=False, collapse_padding=True)
        for column in ("rank", "wall", "goodput", *phases):
            whole.add_column(column.replace("_", "\n"), justify="left" if column == "rank" else "right", no_wrap=True)
        for row in rows:
            run = row.get("whole_run")
            if run:
                whole.add_row(str(row["rank"]), f"{run['wall_s']:.1f}", _share(run["goodput"]),
                              *(f"{run['phases'][p]:.1f}" for p in phases))
        console.print(whole)
    straggler = report.get("straggler")
    if straggler is None:
        known = [row for row in rows if row.get("waiting_for_ranks") is not None]
        if known:
            console.print(f"straggler: none (no rank waits {STRAGGLER_SHARE:.0%} of a step or more for another)")
        return
    waits = [float(row["waiting_for_ranks_s"]) for row in rows if row["rank"] != straggler["rank"]]
    console.print(f"[bold]straggler: rank {straggler['rank']}[/] — its {PHASE_WORDS[straggler['phase']]} "
                  f"({_ms(straggler['seconds_per_step'])}/step, {straggler['share']:.0%} of its step) holds the job "
                  f"back: the other rank(s) wait up to {_ms(max(waits))}/step for it in {collectives}")


def _share(value: object) -> str:
    return f"{value:.0%}" if isinstance(value, (int, float)) else "n/a"

