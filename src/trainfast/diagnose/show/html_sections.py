"""The sections of the HTML page, each from the report's JSON: the step's split, the timeline, the monitor's charts,
the fixes, the loaders, what was observed, the environment, the notes, a torchrun job's ranks and a whole run's
phases."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from trainfast.diagnose.evidence.comms import collective_words
from trainfast.diagnose.report.verify_gains import verified_cell
from trainfast.diagnose.show.html_read import (
    NA,
    _bytes,
    _dict,
    _fmt,
    _kv_tables,
    _legend,
    _list,
    _ms,
    _num,
    _table,
    _value,
)
from trainfast.diagnose.show.look import PARTS as LOOK_PARTS
from trainfast.diagnose.show.look import PHASE_COLOURS as LOOK_PHASES
from trainfast.diagnose.show.svg import escape, line_chart_svg, stacked_bars_svg
from trainfast.diagnose.show.text import gain as gain_text
from trainfast.diagnose.show.text import lost_progress_line, where_line
from trainfast.units import MIB

MAX_BARS = 400  # timeline bars drawn at most; above this, each bar averages consecutive steps


MAX_POINTS = 600  # points per line-chart series at most


# The four parts of a step, bottom to top in the timeline: (key in "fractions", key in a timeline step, label, colour)
# the parts of a step the page shows, bottom to top in the timeline: (key in "fractions", key in a timeline step,
# label, colour)
PARTS = tuple((key, step, label, colour) for key, step, label, _, colour in LOOK_PARTS if colour is not None)


SERIES_COLOURS = ("#1c7ed6", "#e8590c", "#7048e8", "#0ca678", "#d6336c", "#5c940d", "#364fc7", "#f08c00")


PHASE_COLOURS = {phase: colour for phase, (_, colour) in LOOK_PHASES.items()}


def _split(report: dict[str, Any]) -> str:
    fractions = _dict(report.get("fractions"))
    shares = [(label, colour, _num(fractions.get(key))) for key, _, label, colour in PARTS]
    if all(share is None for _, _, share in shares) or not sum(s or 0.0 for _, _, s in shares):
        return f'<p class="muted">{NA}: no step time was measured</p>'
    bar = "".join(f'<div style="width:{100 * max(0.0, share):.3f}%;background:{colour}" title="{escape(label)}"></div>'
                  for label, colour, share in shares if share)
    legend = _legend((f"{escape(label)} <b>{NA if share is None else f'{share:.1%}'}</b>", colour)
                     for label, colour, share in shares)
    return f'<div class="split">{bar}</div>{legend}'


def _timeline(report: dict[str, Any]) -> str:
    steps = [_dict(s) for s in _list(report.get("timeline"))]
    if not steps:
        return f'<p class="muted">{NA}: no measured step</p>'
    warmup = _num(report.get("warmup_steps"))
    first = int(warmup or 0) + 1
    rows = []
    for s in steps:
        parts = [_num(s.get(key)) or 0.0 for _, key, _, _ in PARTS[:-1]]
        total = _num(s.get("total_s"))
        compute = _num(s.get("compute_s"))
        if compute is None:
            compute = max(0.0, (total or 0.0) - sum(parts))
        rows.append([1e3 * v for v in (*parts, compute)])
    per_bar = max(1, math.ceil(len(rows) / MAX_BARS))
    bars, numbers, labels = [], [], []
    for start in range(0, len(rows), per_bar):
        chunk = rows[start:start + per_bar]
        bar = [sum(r[i] for r in chunk) / len(chunk) for i in range(len(PARTS))]
        bars.append(bar)
        numbers.append(float(first + start))
        span = f"step {first + start}" if len(chunk) == 1 else f"steps {first + start}–{first + start + len(chunk) - 1}"
        labels.append(f"{span}: {sum(bar):.1f} ms (" + ", ".join(
            f"{name} {v:.1f}" for (_, _, name, _), v in zip(PARTS, bar, strict=True)) + ")")
    step_s = _num(report.get("step_s"))
    svg = stacked_bars_svg(bars, [c for *_, c in PARTS], labels=labels, x_values=numbers, y_unit="ms",
                           x_label="optimizer step", reference=None if step_s is None else step_s * 1e3)
    caption = [f"{len(rows)} measured steps after {first - 1} warm-up; bar height = step duration"]
    if per_bar > 1:
        caption.append(f"each bar averages {per_bar} consecutive steps")
    if step_s is not None:
        caption.append(f"dashed line = median {step_s * 1e3:,.1f} ms")
    legend = _legend((escape(label), colour) for _, _, label, colour in PARTS)
    return f'{svg}{legend}<div class="caption">{escape("; ".join(caption))}</div>'


def _points(raw: object) -> list[tuple[float, float]]:
    pts = []
    for p in _list(raw):
        pair = _list(p)
        if len(pair) >= 2:
            t, v = _num(pair[0]), _num(pair[1])
            if t is not None and v is not None:
                pts.append((t, v))
    if len(pts) > MAX_POINTS:
        stride = math.ceil(len(pts) / MAX_POINTS)
        pts = pts[::stride] + ([pts[-1]] if (len(pts) - 1) % stride else [])
    return pts


def _chart(title: str, metrics: Sequence[tuple[str, str]], monitor: dict[str, Any], *, unit: str,
           y_floor: float = 0.0, divide: float = 1.0) -> str | None:
    """A titled line chart of the named metrics (metric, label) with a legend of their summaries, or None."""
    series_raw, summary = _dict(monitor.get("series")), _dict(monitor.get("summary"))
    series, legend = [], []
    for index, (metric, label) in enumerate(metrics):
        pts = [(t, v / divide) for t, v in _points(series_raw.get(metric))]  # t: seconds since the monitor started
        if not pts:
            continue
        colour = SERIES_COLOURS[index % len(SERIES_COLOURS)]
        series.append((label, colour, pts))
        stats = _dict(summary.get(metric))
        mean, p95 = _num(stats.get("mean")), _num(stats.get("p95"))
        extra = "" if mean is None else f" — mean {mean / divide:,.0f}" + ("" if p95 is None else
                                                                            f", p95 {p95 / divide:,.0f}")
        legend.append((f"{escape(label)}<span class=\"muted\">{escape(extra)}</span>", colour))
    if not series:
        return None
    return f"<div><h3>{escape(title)}</h3>{line_chart_svg(series, y_unit=unit, y_floor=y_floor)}{_legend(legend)}</div>"


def _monitor(report: dict[str, Any]) -> str:
    monitor = _dict(report.get("monitor"))
    if not monitor:
        return f'<p class="muted">{NA}: the run was not monitored</p>'
    unavailable = {str(k): v for k, v in _dict(monitor.get("unavailable")).items()}
    series = _dict(monitor.get("series"))
    cpu = _chart("CPU", [("cpu.percent", "machine CPU %"), ("workers.cpu_percent", "loader workers CPU %")],
                 monitor, unit="%", y_floor=100.0)
    gpu_metrics = sorted((m for m in series if m.startswith("gpu") and m.endswith(".util")),
                         key=lambda m: (len(m), m))
    gpu = _chart("GPU utilisation", [(m, m.removesuffix(".util").upper()) for m in gpu_metrics], monitor,
                 unit="%", y_floor=100.0)
    memory = _chart("Memory", [("proc.rss_bytes", "training process RSS MiB"),
                               ("workers.rss_bytes", "loader workers RSS MiB")], monitor, unit="MiB", divide=MIB)
    notes = []
    if cpu is None:
        notes.append(f"CPU: {NA} (no CPU series recorded)")
    if gpu is None:
        gpu_sources = [k for k in unavailable if "gpu" in k.lower() or k in ("nvml", "torch.cuda")]
        reasons = [f"{k}: {unavailable.pop(k)}" for k in gpu_sources]
        if not reasons and _dict(report.get("env")).get("cuda_available") is False:
            reasons = ["no CUDA device"]
        notes.append(f"GPU: {NA} ({'; '.join(reasons) or 'no GPU series recorded'})")
    sawtooth = [str(m) for m, flag in _dict(monitor.get("gpu_sawtooth")).items() if flag is True]
    if sawtooth:
        notes.append(f"sawtooth utilisation on {', '.join(sawtooth)}: the GPU idles between batches, waiting "
                     "for input")
    if unavailable:
        notes.append("unavailable: " + "; ".join(f"{k} ({v})" for k, v in unavailable.items()))
    body = "".join(c for c in (cpu, gpu, memory) if c)
    caption = "".join(f'<div class="caption">{escape(n)}</div>' for n in notes)
    return (f'<div class="charts">{body}</div>' if body else "") + caption


def _fixes(report: dict[str, Any]) -> str:
    recs = [_dict(r) for r in _list(report.get("recommendations"))]
    if not recs:
        text = "no fix to recommend from what was measured" if report.get("verdict") else f"{NA}: nothing measured"
        return f'<p class="muted">{escape(text)}</p>'
    items = []
    for rank, rec in enumerate(recs, 1):
        gain = _num(rec.get("expected_gain"))
        basis = "estimate" if rec.get("gain_basis") == "estimate" else "measured"
        reason = f": {rec['gain_basis_reason']}" if basis == "estimate" and rec.get("gain_basis_reason") else ""
        gain_html = (f'<div class="gain" title="expected speed-up, {basis}{escape(reason)}">{gain_text(gain)} '
                     f'<span class="muted">{basis}</span></div>' if gain is not None
                     else '<div class="gain unknown" title="expected speed-up unknown">?</div>')
        run_gain = _num(rec.get("run_gain"))
        if run_gain is not None:  # --whole-run: the gain on the run's wall time
            gain_html += f'<div class="gain" title="gain on the whole run\'s wall time">run {gain_text(run_gain)}</div>'
        measured = _num(rec.get("measured_gain"))
        verified = _dict(_dict(_dict(report.get("verify")).get("gains")).get(str(rec.get("id"))))
        cell = verified_cell(verified)
        if cell:  # --verify re-ran the script with the fix and decided
            gain_html += (f'<div class="gain" title="measured speed-up (--verify): its interval and verdict">measured '
                          f'{escape(" · ".join(cell))}</div>')
        elif measured is not None:  # --verify re-ran the script with the fix
            gain_html += f'<div class="gain" title="measured speed-up (--verify)">measured {gain_text(measured)}</div>'
        if verified.get("trains_differently"):
            gain_html += f'<div class="why">trains differently: {escape(str(verified["trains_differently"]))}</div>'
        rid = f' <span class="muted">({escape(rec["id"])})</span>' if rec.get("id") not in (None, "") else ""
        where = where_line(_dict(rec.get("where"))) if rec.get("where") else ""
        where_html = f'<div class="how">{escape(where)}</div>' if where else ""
        items.append(f'<li><div class="rank">{rank}</div><div class="fix-title">{escape(rec.get("title") or NA)}{rid}'
                     f'</div>{gain_html}<div class="why">{escape(rec.get("why") or NA)}</div>'
                     f'<div class="how">fix: <code>{escape(rec.get("fix") or NA)}</code></div>{where_html}</li>')
    return f'<ol class="fixes">{"".join(items)}</ol>'


def _loader_facts(s: dict[str, Any]) -> list[tuple[str, str]]:
    """One loader's settings and costs as (label, text) pairs, unescaped."""
    startup = [v for v in (_num(x) for x in _list(s.get("startup_s"))) if v is not None]
    per_epoch = s.get("batches_per_epoch")
    hw = _list(s.get("image_hw"))
    return [
        ("kind", _value(s.get("kind"))), ("dataset", _value(s.get("dataset"))),
        ("workers", _value(s.get("num_workers"))), ("prefetch factor", _value(s.get("prefetch_factor"))),
        ("persistent workers", _value(s.get("persistent_workers"))), ("pin memory", _value(s.get("pin_memory"))),
        ("batch size", _value(s.get("batch_size"))), ("bytes per batch", _bytes(s.get("batch_bytes"))),
        ("image h×w", "×".join(map(str, hw)) if hw else NA), ("decode", _value(s.get("decode"))),
        ("in memory", _value(s.get("in_memory"))),
        ("batches", _value(s.get("batches")) + (f" ({_value(per_epoch)} per epoch)" if per_epoch is not None else "")),
        ("epochs", _value(s.get("epochs"))), ("data wait", _fmt(s.get("wait_s"), ",.2f", " s")),
        ("startup (iter → first batch)", ", ".join(f"{v:.2f} s" for v in startup[:6])
         + (" …" if len(startup) > 6 else "") if startup else NA),
    ]


def _loaders(report: dict[str, Any]) -> str:
    loaders = [_dict(s) for s in _list(report.get("loaders"))]
    if not loaders:
        return f'<p class="muted">{NA}: no loader was seen</p>'
    facts = [_loader_facts(s) for s in loaders]
    if len(loaders) == 1:
        return _kv_tables([(escape(k), escape(v)) for k, v in facts[0]])
    headers = ["", *(f"#{_value(s.get('index', i))}" for i, s in enumerate(loaders))]  # one column per loader
    rows = [[(escape(label), False), *((escape(f[row][1]), False) for f in facts)]
            for row, (label, _) in enumerate(facts[0])]
    return _table(headers, rows)


def _observed(report: dict[str, Any]) -> str:
    observed = _dict(report.get("observed"))
    if not observed:
        return f'<p class="muted">{NA}</p>'
    return _kv_tables([(escape(k), escape(_value(v))) for k, v in observed.items()])


def _check_row(check: dict[str, Any]) -> str:
    status = str(check.get("status") or NA)
    css = status if status in ("ok", "warn", "fail", "info") else "info"
    fix = check.get("fix")
    fix_html = f'<div>fix: <code>{escape(fix)}</code></div>' if fix not in (None, "") else ""
    return (f'<li><span class="pill {css}">{escape(status)}</span> <b>{escape(check.get("name") or NA)}</b>'
            f'<div class="muted">{escape(check.get("detail") or "")}</div>{fix_html}</li>')


def _env(report: dict[str, Any]) -> str:
    env = _dict(report.get("env"))
    if not env:
        return f'<p class="muted">{NA}</p>'
    affinity, limit = env.get("cpu_affinity"), env.get("cgroup_cpu_limit")
    cpus = _value(env.get("cpu_count"))
    if affinity is not None:
        cpus += f", affinity {len(affinity) if isinstance(affinity, (list, tuple)) else _value(affinity)}"
    if limit is not None:
        cpus += f", cgroup limit {_value(limit)}"
    gpus = [_dict(g) for g in _list(env.get("gpus"))]
    gpu_text = ", ".join(f"{g.get('name', NA)} ({_bytes(g.get('memory_bytes'))})" for g in gpus) or "none"
    versions = [("Python", _value(env.get("python"))), ("torch", _value(env.get("torch"))),
                ("CUDA available", _value(env.get("cuda_available"))), ("CPUs", cpus),
                ("memory", _bytes(env.get("memory_bytes"))), ("/dev/shm", _bytes(env.get("shm_bytes"))),
                ("GPUs", gpu_text)]
    line = '<p>' + " · ".join(f'<span class="muted">{escape(k)}</span> {escape(v)}' for k, v in versions) + "</p>"
    checks = [_dict(c) for c in _list(env.get("checks"))]
    flagged = sorted((c for c in checks if c.get("status") in ("fail", "warn")),
                     key=lambda c: 0 if c.get("status") == "fail" else 1)
    parts = [line]
    if flagged:
        parts.append(f'<ul class="checks">{"".join(_check_row(c) for c in flagged)}</ul>')
    elif checks:
        parts.append('<p class="muted">no check warned or failed</p>')
    if checks:
        parts.append(f'<details><summary>all {len(checks)} checks</summary>'
                     f'<ul class="checks">{"".join(_check_row(c) for c in checks)}</ul></details>')
    return "".join(parts)


def _notes(report: dict[str, Any]) -> str:
    notes = [n for n in _list(report.get("notes")) if n not in (None, "")]
    if not notes:
        return '<p class="muted">none</p>'
    return '<ul class="notes">' + "".join(f"<li>{escape(n)}</li>" for n in notes) + "</ul>"


def _ranks(report: dict[str, Any]) -> str:
    """A torchrun job: a row per rank, and the straggler the others wait for."""
    collectives = collective_words(list(dict.fromkeys(
        k for r in _list(report.get("ranks")) for k in _list(_dict(r).get("collectives")))))
    rows = []
    for row in (_dict(r) for r in _list(report.get("ranks"))):
        fractions = _dict(row.get("fractions"))
        waiting = _ms(row.get("waiting_for_ranks_s"))
        share = _num(row.get("waiting_for_ranks"))
        rows.append([(escape(_value(row.get("rank"))), True), (escape(_fmt(row.get("samples_per_s"), ",.0f")), True),
                     (escape(_ms(row.get("step_s"))), True),
                     *((escape(_fmt(fractions.get(key), ".0%")), True) for key, *_ in PARTS),
                     (escape(waiting + ("" if share is None else f" ({share:.0%})")), True),
                     (escape(_value(row.get("verdict"))), False)])
    table = _table(["rank", "samples / s", "median step", *(label for _, _, label, _ in PARTS), "waiting for ranks",
                    "own verdict"], rows)
    straggler = _dict(report.get("straggler"))
    if straggler:
        line = (f"straggler: rank {_value(straggler.get('rank'))}, {_value(straggler.get('phase'))}: "
                f"{_ms(straggler.get('seconds_per_step'))} per step ({_fmt(straggler.get('share'), '.0%')} of its "
                f"step), which the other ranks wait for in {collectives}")
    else:
        line = "straggler: none named"
    caption = ("each rank trains its own batches: the job's samples / s is the sum of the ranks'; a rank's wait for "
               f"the others in {collectives} is counted in its own split as communication (blocked in them), or as "
               "compute where the wait is on the device")
    return f'{table}<p>{escape(line)}</p><div class="caption">{escape(caption)}</div>'


def _whole_run(report: dict[str, Any]) -> str:
    """`doctor --whole-run`: the phases over the wall time, goodput, throughput over time and drift."""
    whole = _dict(report.get("whole_run"))
    phases = [_dict(p) for p in _list(whole.get("phases"))]
    wall, goodput = _num(whole.get("wall_s")), _num(whole.get("goodput"))
    head = (f"<p><b>{_fmt(wall, ',.1f', ' s')}</b> of wall time, goodput <b>"
            f"{NA if goodput is None else f'{goodput:.0%}'}</b> (the share in training steps)"
            + (f"; the doctor's own {_fmt(whole.get('doctor_s'), ',.1f', ' s')} left out" if _num(
                whole.get("doctor_s")) else "") + "</p>")
    bar = "".join(f'<div style="width:{100 * max(0.0, _num(p.get("share")) or 0.0):.3f}%;'
                  f'background:{PHASE_COLOURS.get(str(p.get("phase")), "#adb5bd")}" title="{escape(p.get("phase"))}">'
                  "</div>" for p in phases if _num(p.get("share")))
    legend = _legend((f"{escape(p.get('phase'))} <b>{_fmt(p.get('seconds'), ',.2f', ' s')}</b> "
                      f"({_fmt(100 * (_num(p.get('share')) or 0.0), '.1f', ' %')})",
                      PHASE_COLOURS.get(str(p.get("phase")), "#adb5bd")) for p in phases)
    intervals = [_dict(t) for t in _list(whole.get("throughput"))]
    chart = ""
    if intervals:
        keys = ("data_wait_s", "transfer_s", "host_s", "compute_s")
        bars = [[1e3 * (_num(t.get(k)) or 0.0) for k in keys] for t in intervals]
        labels = [f"{_fmt(t.get('start_s'), ',.1f')}-{_fmt(t.get('end_s'), ',.1f')} s: "
                  f"{_fmt(t.get('samples_per_s'), ',.0f')} samples/s over {_value(t.get('steps'))} steps"
                  for t in intervals]
        chart = (stacked_bars_svg(bars, [c for key, *_, c in PARTS if key != "communication"], labels=labels,
                                  x_values=[float(i + 1) for i in range(len(bars))], y_unit="ms",
                                  x_label="interval of the run (each bar: its steps' mean split)")
                 + '<div class="caption">throughput over time: ' + escape(", ".join(
                     _fmt(t.get("samples_per_s"), ",.0f") for t in intervals)) + " samples/s</div>")
    drift = _dict(whole.get("drift"))
    lines = [f"drift: {escape(drift.get('reason') or NA)}"]
    evaluation, checkpoint = _dict(whole.get("evaluation")), _dict(whole.get("checkpoint"))
    if _num(evaluation.get("passes")):
        lines.append(f"evaluation: {_value(evaluation.get('passes'))} pass(es), {_value(evaluation.get('forwards'))} "
                     f"forward(s), {_value(evaluation.get('autocast_forwards'))} under autocast, data wait "
                     f"{_fmt(evaluation.get('data_wait_s'), ',.2f', ' s')}")
    if _num(checkpoint.get("count")):
        lines.append(f"checkpoint: {_value(checkpoint.get('count'))} write(s), {_bytes(checkpoint.get('bytes'))} in "
                     f"{_fmt(checkpoint.get('seconds'), ',.2f', ' s')}; training blocked "
                     f"{_fmt(checkpoint.get('blocking_s'), ',.2f', ' s')}")
    if whole.get("lost_progress"):
        lines.append(f"<b>lost progress</b>: {escape(lost_progress_line(_dict(whole.get('lost_progress'))))}")
    return (head + f'<div class="split">{bar}</div>{legend}{chart}'
            + "".join(f"<p>{line}</p>" for line in lines))
