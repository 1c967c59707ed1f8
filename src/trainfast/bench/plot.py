"""`trainfast bench --plot`: the report as one PNG, four panels, titled with the machine.

matplotlib is the optional `plot` extra, imported only here and only when a plot is asked for. The figure is
drawn on an explicit Agg canvas (`matplotlib.figure.Figure` + `FigureCanvasAgg`) without pyplot: no backend
switch, no global figure registry to leak into, nothing to close.
"""

from __future__ import annotations

import io
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainfast.atomic import write_bytes
from trainfast.bench.hardware import describe
from trainfast.units import MIB

if TYPE_CHECKING:
    from matplotlib.axes import Axes

INSTALL_HINT = "pip install trainfast[plot]"
FP32, MIXED, NEUTRAL, BEST, WAIT, UTIL, OOM = ("#4C72B0", "#DD8452", "#9AA5B1", "#2A9D8F", "#C44E52", "#8172B3",
                                               "#C44E52")


class PlotUnavailableError(ImportError):
    """matplotlib is missing; the message says how to install it."""


def require_matplotlib() -> None:
    """Raise PlotUnavailableError (with the install command) unless matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise PlotUnavailableError(f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}") from e


def plot_report(report: dict[str, Any], path: str | Path) -> Path:
    """Write the report as a PNG at `path` (atomically) and return the path."""
    return write_bytes(path, plot_png(report))


def plot_png(report: dict[str, Any]) -> bytes:
    """The report drawn as a PNG."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 9), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 2)
    _workers_panel(fig.add_subplot(grid[0, 0]), report)
    _versus_panel(fig.add_subplot(grid[0, 1]), report)
    _precision_panel(fig.add_subplot(grid[1, 0]), report, "samples_per_s")
    _precision_panel(fig.add_subplot(grid[1, 1]), report, "peak_mem_bytes")
    command = report.get("command") or "trainfast bench"
    fig.suptitle(f"trainfast bench on {describe(report['hardware'])}\n{command}", fontsize=12)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", facecolor="white")
    return buffer.getvalue()


def _style(ax: Axes) -> None:
    ax.spines[["top"]].set_visible(False)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def _workers_panel(ax: Axes, report: dict[str, Any]) -> None:
    rows = report["workers"]
    settings = report.get("settings", {})
    ok = [r for r in rows if r.get("samples_per_s")]
    best = max(ok, key=lambda r: r["samples_per_s"])["num_workers"] if ok else None
    xs = list(range(len(rows)))
    rates = [r.get("samples_per_s") or 0.0 for r in rows]
    colors = [BEST if r["num_workers"] == best else FP32 for r in rows]
    bars = ax.bar(xs, rates, color=colors, width=0.6, label="samples/s")
    for bar, r in zip(bars, rows, strict=True):
        label = f"{r['samples_per_s']:,.0f}" if r.get("samples_per_s") else ("OOM" if r.get("oom") else "failed")
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), xytext=(0, 3),
                    textcoords="offset points", ha="center", va="bottom", fontsize=8,
                    color=OOM if not r.get("samples_per_s") else "black")
    ax.set_xticks(xs, [f"{r['num_workers']}\n{r.get('cpu_threads', '?')} thr" for r in rows])
    ax.set_xlabel("num_workers (loader processes) / intra-op threads")
    ax.set_ylabel("samples/s")
    ax.set_ylim(0, max([*rates, 1.0]) * 1.3)
    _style(ax)
    share = ax.twinx()
    waits = [100 * r["data_wait_fraction"] if r.get("data_wait_fraction") is not None else float("nan") for r in rows]
    utils = [r["util"] if r.get("util") is not None else float("nan") for r in rows]
    source = "GPU" if {r.get("util_source") for r in rows} == {"gpu"} else "CPU"
    share.plot(xs, waits, color=WAIT, marker="o", label="data wait %")
    share.plot(xs, utils, color=UTIL, marker="s", linestyle="--", label=f"{source} util %")
    share.set_ylim(0, 135)  # room above 100 % for the legend
    share.set_yticks(range(0, 101, 20))
    share.set_ylabel("% of training time")
    share.spines[["top"]].set_visible(False)
    handles = [*ax.get_legend_handles_labels()[0], *share.get_legend_handles_labels()[0]]
    share.legend(handles, [str(h.get_label()) for h in handles], loc="upper center", ncols=3, fontsize=8,
                 framealpha=0.9)
    ax.set_title(f"Loader workers: batch {settings.get('batch_size', 64)}, {settings.get('image_size', 64)} px "
                 f"(fastest: num_workers={best})", fontsize=11)


def _precision_panel(ax: Axes, report: dict[str, Any], metric: str) -> None:
    rows = report["precision"]
    batches = sorted({r["batch_size"] for r in rows})
    precisions = list(dict.fromkeys(r["precision"] for r in rows))
    width = 0.8 / max(1, len(precisions))
    scale = MIB if metric == "peak_mem_bytes" else 1.0  # the axis is in MiB
    top = max([(r.get(metric) or 0) / scale for r in rows] + [1.0])
    for p, precision in enumerate(precisions):
        color = FP32 if precision == "32-true" else MIXED
        for b, batch in enumerate(batches):
            found = [r for r in rows if r["precision"] == precision and r["batch_size"] == batch]
            if not found:
                continue
            r = found[0]
            x = b + (p - (len(precisions) - 1) / 2) * width
            label = precision if b == 0 else None
            if r.get("oom") or r.get(metric) is None:
                ax.bar(x, top * 0.12, width=width * 0.95, color="white", edgecolor=OOM, hatch="///", label=label)
                ax.annotate("OOM", (x, top * 0.12), xytext=(0, 3), textcoords="offset points", ha="center",
                            va="bottom", fontsize=9, color=OOM, fontweight="bold")
                continue
            value = r[metric] / scale
            ax.bar(x, value, width=width * 0.95, color=color, label=label)
            text = f"{value:,.0f}"
            if metric == "samples_per_s" and precision != "32-true" and r.get("speed_vs_fp32"):
                text += f"\n{r['speed_vs_fp32']:.2f}x"
            ax.annotate(text, (x, value), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                        fontsize=8)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylim(0, top * 1.25)
    _style(ax)
    ax.legend(fontsize=8, loc="upper left")
    if metric == "samples_per_s":
        ax.set_ylabel("samples/s")
        ax.set_title("Precision x batch size: throughput (label: x fp32 at the same batch)", fontsize=11)
    else:
        source = {r.get("mem_source") for r in rows}
        what = "CUDA max allocated" if source == {"cuda"} else "peak RSS growth" if source == {"rss"} else "peak"
        ax.set_ylabel(f"MiB ({what})")
        ax.set_title(f"Precision x batch size: peak memory ({what})", fontsize=11)


def _versus_panel(ax: Axes, report: dict[str, Any]) -> None:
    v = report.get("naive_vs_trainfast") or {}
    spec = v.get("spec") or {}
    steps = f": {spec['epochs']} x {spec['batches_per_epoch']} batches" if spec else ""
    ax.set_title(f"Naive loop vs trainfast (same model, data and steps{steps})", fontsize=11)
    if "naive" not in v:
        ax.axis("off")
        ax.text(0.5, 0.5, textwrap.fill(f"not measured: {v.get('skipped', 'no result')}", 60), ha="center",
                va="center", fontsize=10, transform=ax.transAxes)
        return
    runs = [v["naive"], v["trainfast"]]
    rates = [r["samples_per_s"] for r in runs]
    bars = ax.barh([0, 1], rates, color=[NEUTRAL, BEST], height=0.55)
    ax.set_yticks([0, 1], ["naive", "trainfast"])
    ax.invert_yaxis()
    for bar, r in zip(bars, runs, strict=True):
        ax.annotate(f"{r['samples_per_s']:,.0f} samples/s\n{r['data_wait_fraction']:.0%} data wait",
                    (bar.get_width(), bar.get_y() + bar.get_height() / 2), xytext=(4, 0),
                    textcoords="offset points", ha="left", va="center", fontsize=9)
    ax.set_xlim(0, max([*rates, 1.0]) * 1.45)
    ax.set_xlabel("samples/s")
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    speedup = v.get("speedup")
    if speedup:
        ax.text(0.98, 0.5, f"{speedup:.2f}x " + ("faster" if speedup >= 1 else "(slower)"), transform=ax.transAxes,
                ha="right", va="center", fontsize=16, fontweight="bold", color=BEST if speedup >= 1 else WAIT)
