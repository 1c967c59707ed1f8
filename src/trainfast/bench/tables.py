"""`trainfast bench`'s report as rich tables for the terminal and as GitHub markdown.

Both renderings come from the same cells (`workers_cells`, `precision_cells`), so the terminal, the markdown
file and the JSON never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from trainfast.bench.hardware import describe
from trainfast.units import format_bytes

MISSING = "–"


@dataclass(frozen=True)
class Cells:
    """One table: a title, column headers, rows of text cells, the row to highlight, and notes below it."""

    title: str
    headers: list[str]
    rows: list[list[str]]
    best: int | None
    notes: list[str]


def fmt_rate(x: float | None) -> str:
    return MISSING if x is None else f"{x:,.0f}"


def fmt_pct(x: float | None, scale: float = 100.0) -> str:
    return MISSING if x is None else f"{x * scale:.0f}%"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return MISSING
    return f"{s:.2f} s" if s < 10 else f"{s:,.1f} s"


def util_header(rows: list[dict[str, Any]]) -> str:
    sources = {r.get("util_source") for r in rows}
    return "GPU util" if sources == {"gpu"} else "CPU util" if sources == {"cpu"} else "util"


def workers_cells(report: dict[str, Any]) -> Cells:
    rows = report["workers"]
    settings = report.get("settings", {})
    timed = [i for i, r in enumerate(rows) if r.get("samples_per_s")]
    best = max(timed, key=lambda i: rows[i]["samples_per_s"]) if timed else None
    body = []
    for r in rows:
        if r.get("error"):
            body.append([str(r["num_workers"]), str(r.get("cpu_threads", MISSING)),
                         "OOM" if r.get("oom") else "failed", MISSING, MISSING, MISSING])
            continue
        body.append([str(r["num_workers"]), str(r.get("cpu_threads", MISSING)), fmt_seconds(r["epoch_s"]),
                     fmt_rate(r["samples_per_s"]), fmt_pct(r["data_wait_fraction"]),
                     fmt_pct(r["util"], scale=1.0)])
    notes = []
    measured = {(r.get("batches_measured"), r.get("batches_per_epoch")) for r in rows}
    if any(r.get("epoch_extrapolated") for r in rows) and len(measured) == 1:
        (done, total), = measured
        notes.append(f"epoch time: a full epoch of {total} batches extrapolated from {done} measured batches "
                     f"(steady-state rate, first {settings.get('warmup_steps_excluded', 3)} steps excluded)")
    else:
        notes.append(f"epoch time: one epoch at the steady-state rate (first "
                     f"{settings.get('warmup_steps_excluded', 3)} steps excluded; worker start-up not included)")
    device = report.get("device", "cpu")
    if str(device).startswith("cpu"):
        notes.append("threads: intra-op threads (cpu_threads='auto': the usable CPUs left beside the workers); "
                     "CPU util: mean over all cores while training")
    else:
        notes.append("threads: torch's intra-op threads; GPU util: NVML's busy share of the busiest GPU while "
                     "training")
    if report.get("data_format") == "packed":
        notes.append(f"data: {report.get('dataset', '')}/train, packed by 'trainfast pack' (JPEG shards, read "
                     "through memory maps)")
    failed = [r for r in rows if r.get("error")]
    notes += [f"num_workers={r['num_workers']}: {r['error']}" for r in failed]
    batch = settings.get("batch_size", 64)
    size = settings.get("image_size", 64)
    precision = settings.get("workers_precision", "32-true")
    title = f"Loader workers: ConvNet, {size} px, batch {batch}, {precision}, on {device}"
    return Cells(title, ["num_workers", "threads", "epoch time", "samples/s", "data wait", util_header(rows)],
                 body, best, notes)


def precision_cells(report: dict[str, Any]) -> Cells:
    rows = report["precision"]
    sources = {r.get("mem_source") for r in rows}
    memory = ("peak memory (CUDA allocated)" if sources == {"cuda"} else
              "peak memory (RSS growth)" if sources == {"rss"} else "peak memory")
    body = []
    for r in rows:
        if r.get("oom"):
            body.append([r["precision"], str(r["batch_size"]), "OOM", MISSING, MISSING])
            continue
        speed = r.get("speed_vs_fp32")
        body.append([r["precision"], str(r["batch_size"]), format_bytes(r["peak_mem_bytes"], missing=MISSING),
                     fmt_rate(r["samples_per_s"]), MISSING if speed is None else f"{speed:.2f}x"])
    timed = [i for i, r in enumerate(rows) if r.get("samples_per_s")]
    best = max(timed, key=lambda i: rows[i]["samples_per_s"]) if timed else None
    notes = ["in-memory synthetic uint8 images: compute only, no JPEG decode"]
    if sources == {"rss"}:
        notes.append("RSS growth: this process's peak resident memory during the row minus before it "
                     "(weights, gradients, optimizer state, activations)")
    elif sources == {"cuda"}:
        notes.append("CUDA allocated: torch.cuda.max_memory_allocated over the row")
    if any(r.get("oom") for r in rows):
        notes.append("OOM: the row ran out of memory; the run went on")
    steps = {r.get("steps") for r in rows}
    if len(steps) == 1:
        step, = steps
        notes.append(f"{step} steps per row, first {report.get('settings', {}).get('warmup_steps_excluded', 3)} "
                     "excluded from samples/s")
    return Cells(f"Precision x batch size: ConvNet, on {report.get('device', 'cpu')}",
                 ["precision", "batch", memory, "samples/s", "speed vs fp32 at same batch"], body, best, notes)


def versus_line(report: dict[str, Any]) -> str:
    """One line: naive vs trainfast on the same data, or why that comparison was skipped."""
    v = report.get("naive_vs_trainfast") or {}
    if "skipped" in v:
        return f"naive vs trainfast: skipped ({v['skipped']})"
    if "naive" not in v:
        return "naive vs trainfast: not measured"
    naive, fast, spec = v["naive"], v["trainfast"], v.get("spec", {})
    speedup = f"{v['speedup']:.2f}x samples/s" if v.get("speedup") else "speedup n/a"
    epochs = f"{spec['epochs']} epoch" + ("s" if spec.get("epochs") != 1 else "") if spec else ""
    runs = f" ({epochs} x {spec['batches_per_epoch']} batches, same model and data)" if spec else ""
    return (f"naive vs trainfast{runs}: naive {naive['samples_per_s']:,.0f} samples/s "
            f"({naive['data_wait_fraction']:.0%} data wait) -> trainfast {fast['samples_per_s']:,.0f} samples/s "
            f"({fast['data_wait_fraction']:.0%} data wait): {speedup}{_devices(naive, fast)}{_reads(v.get('reads'))}")


def _devices(naive: dict[str, Any], fast: dict[str, Any]) -> str:
    """Where each run trained, where the report says (reports before runs recorded it say nothing); two devices
    are named apart, since their ratio then measures the hardware as much as the practices."""
    a, b = naive.get("device"), fast.get("device")
    if a is None or b is None:
        return ""
    return f", both on {a}" if a == b else f" (naive on {a}, trainfast on {b}: not comparable)"


def _reads(reads: dict[str, Any] | None) -> str:
    """What both runs read, where the report says (reports before `reads` existed say nothing)."""
    if not reads or reads.get("naive", {}).get("format") != "packed":
        return ""
    return ("; both read the packed shards ('trainfast pack'), the naive run decoding them in full in the main "
            "process")


def rich_table(cells: Cells) -> Table:
    table = Table(title=cells.title, title_justify="left")
    for i, header in enumerate(cells.headers):
        table.add_column(header, justify="left" if i == 0 else "right")
    for i, row in enumerate(cells.rows):
        style = "bold green" if i == cells.best else "red" if "OOM" in row or "failed" in row else None
        table.add_row(*row, style=style)
    return table


def render(report: dict[str, Any], console: Console) -> None:
    """The two tables and the naive vs trainfast line, on `console`."""
    for cells in (workers_cells(report), precision_cells(report)):
        console.print()
        console.print(rich_table(cells))
        for note in cells.notes:
            console.print(f"  {note}", style="dim", markup=False, highlight=False)
    console.print()
    console.print(versus_line(report), markup=False, highlight=False)
    console.print(describe(report["hardware"]), markup=False, highlight=False)


def markdown_table(cells: Cells) -> str:
    def line(values: list[str]) -> str:
        return "| " + " | ".join(v.replace("|", "\\|") for v in values) + " |"

    body = [line(cells.headers), line(["---"] * len(cells.headers))]
    for i, row in enumerate(cells.rows):
        body.append(line([f"**{v}**" if i == cells.best and v != MISSING else v for v in row]))
    notes = "\n".join(f"- {n}" for n in cells.notes)
    return f"### {cells.title}\n\n" + "\n".join(body) + ("\n\n" + notes if notes else "") + "\n"


def to_markdown(report: dict[str, Any]) -> str:
    """The same tables as GitHub markdown, with the machine and the command that produced them."""
    command = report.get("command") or "trainfast bench"
    wall = f" Measuring took {report['wall_s']:.0f} s." if report.get("wall_s") else ""
    return (f"## trainfast bench\n\n"
            f"**Machine:** {describe(report['hardware'])}, {report['hardware'].get('platform', '')}.  \n"
            f"**Command:** `{command}`.{wall} Bold: the fastest row.\n\n"
            f"{markdown_table(workers_cells(report))}\n"
            f"{markdown_table(precision_cells(report))}\n"
            f"### Naive vs trainfast\n\n{versus_line(report)}\n")
