"""The doctor's report as one self-contained HTML page: inline CSS and inline SVG, nothing fetched, no script.

`render_html(report)` takes the dict of `Report.to_json()`. Every field may be missing, None or of an odd
type (the JSON may come from an older or a failed run): what cannot be shown reads "n/a". Every string taken
from the report is escaped, because script arguments and error messages are user input.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from typing import Any

from trainfast.diagnose.show.html_read import NA, _dict, _fmt, _list, _num, _value
from trainfast.diagnose.show.html_sections import (
    _env,
    _fixes,
    _loaders,
    _monitor,
    _notes,
    _observed,
    _ranks,
    _split,
    _timeline,
    _whole_run,
)
from trainfast.diagnose.show.look import NO_VERDICT, VERDICTS
from trainfast.diagnose.show.svg import escape

CSS = """
*{box-sizing:border-box}
body{margin:0;background:#f4f5f7;color:#1f2328;
 font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,"Noto Sans",sans-serif}
main{max-width:1100px;margin:0 auto;padding:28px 24px 56px}
header h1{font-size:24px;margin:0;font-weight:650;word-break:break-word}
header .sub{color:#59636e;margin-top:4px;font-size:14px}
.banner{border-radius:12px;padding:16px 22px;color:#fff;margin:18px 0 14px}
.banner .name{font-size:22px;font-weight:750;letter-spacing:.04em;text-transform:uppercase}
.banner .reason{font-size:15px;opacity:.95;margin-top:2px}
.figures{display:grid;grid-template-columns:repeat(auto-fit,minmax(190px,1fr));gap:12px}
.figure{background:#fff;border:1px solid #e2e5e9;border-radius:12px;padding:12px 18px}
.figure .value{font-size:26px;font-weight:650;font-variant-numeric:tabular-nums}
.figure .label{color:#59636e;font-size:13px}
section{background:#fff;border:1px solid #e2e5e9;border-radius:12px;padding:18px 22px;margin:14px 0}
h2{font-size:17px;margin:0 0 12px;font-weight:650}
h3{font-size:14px;margin:0 0 6px;font-weight:600;color:#3d444d}
.split{display:flex;height:30px;border-radius:7px;overflow:hidden;background:#eceef1}
.split div{height:100%}
.legend{display:flex;flex-wrap:wrap;gap:4px 20px;font-size:13px;color:#3d444d;margin-top:10px}
.swatch{display:inline-block;width:11px;height:11px;border-radius:3px;margin-right:6px;vertical-align:-1px}
.muted{color:#6b7280}
.caption{color:#6b7280;font-size:13px;margin-top:6px}
svg.chart{width:100%;height:auto;display:block}
svg.chart text{font-size:11px;fill:#59636e}
.charts{display:grid;grid-template-columns:repeat(auto-fit,minmax(440px,1fr));gap:18px 26px}
table{border-collapse:collapse;width:100%;font-size:14px}
th,td{text-align:left;padding:6px 10px;border-bottom:1px solid #eceef1;vertical-align:top}
th{font-weight:600;color:#59636e;font-size:12px;text-transform:uppercase;letter-spacing:.03em;white-space:nowrap}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.scroll{overflow-x:auto}
code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"Liberation Mono",monospace;font-size:13px;
 background:#f1f3f5;padding:2px 6px;border-radius:5px;white-space:pre-wrap;word-break:break-word}
ol.fixes{list-style:none;margin:0;padding:0}
ol.fixes li{display:grid;grid-template-columns:34px 1fr auto;gap:4px 12px;padding:12px 0;
 border-bottom:1px solid #eceef1}
ol.fixes li:last-child{border-bottom:0}
.rank{width:26px;height:26px;border-radius:50%;background:#eef1f4;color:#3d444d;font-weight:650;
 display:flex;align-items:center;justify-content:center;font-size:13px}
.fix-title{font-weight:600}
.gain{font-weight:700;font-variant-numeric:tabular-nums;color:#2b8a3e;font-size:16px}
.gain.unknown{color:#8b949e}
.why{color:#3d444d;grid-column:2/4}
.how{grid-column:2/4}
.pill{display:inline-block;padding:1px 8px;border-radius:999px;font-size:11.5px;font-weight:650;
 text-transform:uppercase;letter-spacing:.03em}
.pill.warn{background:#fff4e0;color:#9a5b00}.pill.fail{background:#fdecec;color:#b42318}
.pill.ok{background:#e8f6ee;color:#1e7d45}.pill.info{background:#edf1ff;color:#3949ab}
ul.checks{list-style:none;margin:8px 0 0;padding:0}
ul.checks li{padding:8px 0;border-bottom:1px solid #eceef1}
ul.checks li:last-child{border-bottom:0}
details{margin-top:12px}
summary{cursor:pointer;color:#3d444d;font-size:14px}
.kv{display:grid;grid-template-columns:repeat(auto-fit,minmax(320px,1fr));gap:0 26px;align-items:start}
.kv table td:first-child{color:#59636e;width:45%}
#loaders td:first-child{color:#59636e}
ul.notes{margin:0;padding-left:20px}
pre{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"Liberation Mono",monospace;font-size:12.5px;
 background:#fff;border:1px solid #e2e5e9;border-radius:8px;padding:10px 14px;overflow-x:auto;white-space:pre-wrap}
.oom{background:#fdecec;color:#7a1a12;border-radius:8px;padding:10px 14px;margin:12px 0 0;font-size:14px}
footer{color:#8b949e;font-size:12px;text-align:center;margin-top:22px}
"""


def render_html(report: dict[str, Any]) -> str:
    """The report (`Report.to_json()`) as one self-contained HTML page."""
    report = _dict(report)
    target = _dict(report.get("script")).get("target")
    title = "trainfast doctor" + (f" — {target}" if target not in (None, "") else "")
    body = [_safely(_header, report), _safely(_banner, report), _safely(_figures, report)]
    sections = list(SECTIONS)
    if _list(report.get("ranks")):  # a torchrun job's report
        sections.insert(1, ("Ranks", "ranks", _ranks))
    if report.get("whole_run"):  # doctor --whole-run
        sections.insert(0, ("The whole run", "whole-run", _whole_run))
    body += [_section(heading, _safely(render, report), anchor) for heading, anchor, render in sections]
    return ("<!DOCTYPE html>\n"
            '<html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{escape(title)}</title><style>{CSS}</style></head>"
            f'<body><main>{"".join(body)}<footer>trainfast doctor report</footer></main></body></html>\n')


SECTIONS: tuple[tuple[str, str, Callable[[dict[str, Any]], str]], ...] = (
    ("Where the step time goes", "split", _split),
    ("Timeline", "timeline", _timeline),
    ("Monitor", "monitor", _monitor),
    ("Fixes, largest expected gain first", "fixes", _fixes),
    ("Loaders", "loaders", _loaders),
    ("Observed", "observed", _observed),
    ("Environment", "environment", _env),
    ("Notes", "notes", _notes),
)


def _safely(render: Callable[[dict[str, Any]], str], report: dict[str, Any]) -> str:
    """A section that cannot be drawn from an odd report says so instead of losing the whole page."""
    try:
        return render(report)
    except Exception as exc:  # the report is data from elsewhere: show what broke
        return f'<p class="muted">{NA} (could not render: {escape(type(exc).__name__)}: {escape(exc)})</p>'


def _section(title: str, body: str, anchor: str) -> str:
    return f'<section id="{anchor}"><h2>{escape(title)}</h2>{body}</section>'


def _header(report: dict[str, Any]) -> str:
    script = _dict(report.get("script"))
    target = script.get("target")
    title = "trainfast doctor" + (f" — {target}" if target not in (None, "") else "")
    parts = []
    args = script.get("args")
    if target not in (None, ""):
        if isinstance(args, (list, tuple)):
            args_text = shlex.join(str(a) for a in args)
        else:
            args_text = "" if args is None else str(args)
        parts.append(f"<code>{escape(' '.join(filter(None, [str(target), args_text])))}</code>")
    outcome = script.get("outcome")
    if outcome not in (None, ""):
        code = script.get("exit_code")
        parts.append(f"run: {escape(outcome)}" + (f" (exit code {escape(code)})" if code is not None else ""))
    sub = f'<div class="sub">{" · ".join(parts)}</div>' if parts else ""
    errors = "".join(f"<details><summary>{escape(key)}</summary><pre>{escape(script[key])}</pre></details>"
                     for key in ("error", "traceback") if script.get(key) not in (None, ""))
    return f"<header><h1>{escape(title)}</h1>{sub}{_oom(report)}{errors}</header>"


def _oom(report: dict[str, Any]) -> str:
    """The script died of an out-of-memory error: where, the error's first line, and what to change."""
    oom = report.get("oom")
    if not isinstance(oom, Mapping):
        return ""
    step, device = oom.get("step"), oom.get("device")
    where = (f"at step {escape(step)}" if step not in (None, "") else "before its first training step") + (
        f" on {escape(device)}" if device not in (None, "") else "")
    message = str(oom.get("message") or "out of memory").rstrip(".")
    advice = oom.get("advice")
    return (f'<p class="oom"><strong>The script ran out of memory {where}</strong>: {escape(message)}.'
            + (f" {escape(str(advice).rstrip('.'))}." if advice not in (None, "") else "") + "</p>")


def _banner(report: dict[str, Any]) -> str:
    verdict = report.get("verdict")
    name = str(verdict) if verdict not in (None, "") else None
    colour = VERDICTS.get(name or "", NO_VERDICT)[1]
    reason = report.get("verdict_reason")
    reason_text = escape(reason) if reason not in (None, "") else ("no optimizer step was measured" if name is None
                                                                else NA)
    label = f"verdict: {name}" if name else f"verdict: {NA}"
    return (f'<div class="banner" style="background:{colour}"><div class="name">{escape(label)}</div>'
            f'<div class="reason">{reason_text}</div></div>')


def _figures(report: dict[str, Any]) -> str:
    step_s = _num(report.get("step_s"))
    steps, warmup = report.get("steps_measured"), report.get("warmup_steps")
    wait = _num(report.get("data_wait_fraction"))
    if wait is None:
        wait = _num(_dict(report.get("fractions")).get("data_wait"))
    world = _num(report.get("world_size"))
    rate_label = f"samples / s over {int(world)} ranks" if world is not None and world > 1 else "samples / s"
    figures = [(rate_label, _fmt(report.get("samples_per_s"), ",.0f")),
               ("median step", NA if step_s is None else f"{step_s * 1e3:,.1f} ms"),
               ("steps measured / warm-up", f"{_value(steps) if _num(steps) is not None else NA} / "
                                            f"{_value(warmup) if _num(warmup) is not None else NA}"),
               ("waiting for data", NA if wait is None else f"{wait:.0%}")]
    return '<div class="figures">' + "".join(
        f'<div class="figure"><div class="value">{escape(value)}</div><div class="label">{escape(label)}</div></div>'
        for label, value in figures) + "</div>"




