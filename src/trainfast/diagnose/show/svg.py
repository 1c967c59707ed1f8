"""Small, dependency-free SVG charts: stacked bars and line charts with axes, for the HTML report."""

from __future__ import annotations

import bisect
import html
import math
from collections.abc import Callable, Iterable, Sequence


def escape(value: object) -> str:
    """Any value as escaped HTML/SVG text (quotes too: it also goes into attributes)."""
    return html.escape(str(value), quote=True)


def _nice_step(span: float, ticks: int = 5) -> float:
    raw = max(span, 1e-12) / ticks
    magnitude = 10.0 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * magnitude >= raw * 0.999)


def _tick(value: float) -> str:
    return f"{value:,.0f}" if abs(value - round(value)) < 1e-9 else f"{value:,.3g}"


def _axes(width: float, height: float, box: tuple[float, float, float, float], y_max: float, y_step: float,
          y_unit: str, x_ticks: Iterable[tuple[float, str]], x_label: str) -> list[str]:
    """Grid lines, y tick labels, x tick labels and axis titles for a plot area box = (left, top, right, bottom)."""
    left, top, right, bottom = box
    out = []
    steps = round(y_max / y_step)
    for i in range(steps + 1):
        y = bottom - (bottom - top) * i / steps
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#e9ecef" stroke-width="1"/>')
        out.append(f'<text x="{left - 6}" y="{y + 3.5:.1f}" text-anchor="end">{escape(_tick(i * y_step))}</text>')
    out.append(f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#adb5bd" stroke-width="1"/>')
    for x, label in x_ticks:
        out.append(f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 4}" stroke="#adb5bd"/>')
        out.append(f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{escape(label)}</text>')
    out.append(f'<text x="{(left + right) / 2:.1f}" y="{height - 4}" text-anchor="middle">{escape(x_label)}</text>')
    out.append(f'<text x="12" y="{(top + bottom) / 2:.1f}" text-anchor="middle" '
               f'transform="rotate(-90 12 {(top + bottom) / 2:.1f})">{escape(y_unit)}</text>')
    return out


def _x_ticks(lo: float, hi: float, to_x: Callable[[float], float], fmt: Callable[[float], str],
             count: int = 8) -> list[tuple[float, str]]:
    if hi <= lo:
        return [(to_x(lo), fmt(lo))]
    step = _nice_step(hi - lo, count)
    first = math.ceil(lo / step) * step
    values = [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]
    return [(to_x(v), fmt(v)) for v in values]


def stacked_bars_svg(bars: Sequence[Sequence[float]], colours: Sequence[str], *, labels: Sequence[str] = (),
                     x_values: Sequence[float] = (), y_unit: str = "", x_label: str = "",
                     reference: float | None = None, width: int = 1000, height: int = 280) -> str:
    """Vertical stacked bars (one per entry of `bars`, segments bottom to top in `colours` order), a y axis and
    numbered x ticks. `labels` are hover tooltips per bar, `x_values` the number shown under each bar,
    `reference` a dashed horizontal line (e.g. the median)."""
    left, top, right, bottom = 58.0, 12.0, width - 12.0, height - 34.0
    totals = [sum(max(0.0, v) for v in bar) for bar in bars]
    top_value = max([*totals, reference or 0.0, 1e-9])
    y_step = _nice_step(top_value)
    y_max = math.ceil(top_value / y_step * 0.999999) * y_step
    n = max(1, len(bars))
    slot = (right - left) / n
    gap = min(2.0, slot * 0.2) if slot >= 4 else 0.0
    bar_w = min(slot - gap, 48.0) if gap else slot + 0.4  # thin bars overlap a little: no seams between them
    scale = (bottom - top) / y_max
    xs = list(x_values) or [float(i + 1) for i in range(len(bars))]

    def bar_x(i: float) -> float:
        return left + slot * (i + 0.5)

    ticks = []  # at round numbers, under the bar that holds them (x_values ascend)
    if bars:
        step = max(1.0, _nice_step(xs[-1] - xs[0], 10))
        value = math.ceil(xs[0] / step) * step
        while value <= xs[-1] + 1e-9:
            ticks.append((bar_x(bisect.bisect_right(xs, value + 1e-9) - 1), _tick(value)))
            value += step
    out = [f'<svg class="chart" viewBox="0 0 {width} {height}" role="img">']
    out += _axes(width, height, (left, top, right, bottom), y_max, y_step, y_unit, ticks, x_label)
    for i, bar in enumerate(bars):
        x = left + slot * (i + 0.5) - bar_w / 2
        y = bottom
        tip = f"<title>{escape(labels[i])}</title>" if i < len(labels) else ""
        rects = []
        for value, colour in zip(bar, colours, strict=False):
            h = max(0.0, value) * scale
            if h <= 0:
                continue
            y -= h
            rects.append(f'<rect x="{x:.2f}" y="{y:.2f}" width="{bar_w:.2f}" height="{h:.2f}" fill="{colour}"/>')
        out.append(f"<g>{tip}{''.join(rects)}</g>")
    if reference is not None and reference > 0:
        y = bottom - reference * scale
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#343a40" '
                   f'stroke-width="1" stroke-dasharray="5 4"/>')
    out.append("</svg>")
    return "".join(out)


def line_chart_svg(series: Sequence[tuple[str, str, Sequence[tuple[float, float]]]], *, y_unit: str = "",
                   x_label: str = "time (s)", y_floor: float = 0.0, width: int = 520, height: int = 220) -> str:
    """Line chart of (name, colour, [(x, y), ...]) series sharing axes; the y axis runs from 0 to at least
    `y_floor` (100 for percentages)."""
    left, top, right, bottom = 52.0, 12.0, width - 14.0, height - 34.0
    points = [p for _, _, pts in series for p in pts]
    x_lo = min(0.0, *(p[0] for p in points))
    x_hi = max((p[0] for p in points), default=1.0)
    top_value = max([y_floor, 1e-9, *(p[1] for p in points)])
    y_step = _nice_step(top_value)
    y_max = math.ceil(top_value / y_step * 0.999999) * y_step

    def to_x(t: float) -> float:
        return left + (t - x_lo) / (x_hi - x_lo) * (right - left) if x_hi > x_lo else (left + right) / 2

    def to_y(v: float) -> float:
        return bottom - max(0.0, v) / y_max * (bottom - top)

    out = [f'<svg class="chart" viewBox="0 0 {width} {height}" role="img">']
    out += _axes(width, height, (left, top, right, bottom), y_max, y_step, y_unit,
                 _x_ticks(x_lo, x_hi, to_x, _tick, count=6), x_label)
    for name, colour, pts in series:
        if len(pts) == 1:
            out.append(f'<circle cx="{to_x(pts[0][0]):.1f}" cy="{to_y(pts[0][1]):.1f}" r="3" fill="{colour}">'
                       f"<title>{escape(name)}</title></circle>")
        elif pts:
            coords = " ".join(f"{to_x(t):.1f},{to_y(v):.1f}" for t, v in pts)
            out.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="1.8" '
                       f'stroke-linejoin="round"><title>{escape(name)}</title></polyline>')
    out.append("</svg>")
    return "".join(out)
