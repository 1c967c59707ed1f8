"""The doctor's HTML report: one self-contained page, every section, user strings escaped, bounded size,
and (with Chromium installed) a page that actually renders."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainfast.diagnose.show.html import render_html
from trainfast.diagnose.show.html_sections import MAX_BARS

HEADINGS = ("Where the step time goes", "Timeline", "Monitor", "Fixes, largest expected gain first", "Loaders",
            "Observed", "Environment", "Notes")
EVIL = "<script>alert(1)</script>"
CHROMIUM = Path("/usr/bin/chromium")


def _steps(n: int) -> list[dict[str, Any]]:
    steps, end = [], 0.0
    for i in range(n):
        wait = 0.030 + (0.050 if i % 7 == 0 else 0.004 * (i % 3))
        transfer, host, compute = 0.003, 0.006, 0.018 + 0.001 * (i % 4)
        total = wait + transfer + host + compute
        end += total
        steps.append({"end_s": end, "total_s": total, "wait_s": wait, "transfer_s": transfer, "host_s": host,
                      "compute_s": compute, "samples": 64, "syncs": 1})
    return steps


def synthetic_report(steps: int = 60) -> dict[str, Any]:
    """What `Report.to_json()` gives for a CPU run starved by its loader: monitor without GPU, one warn check."""
    cpu = [[0.5 * i, 40 + 30 * math.sin(i / 5)] for i in range(80)]
    workers = [[0.5 * i, 150 + 20 * math.cos(i / 4)] for i in range(80)]
    rss = [[0.5 * i, (900 + 2 * i) * 1024**2] for i in range(80)]
    wrss = [[0.5 * i, (1500 + 5 * i) * 1024**2] for i in range(80)]
    return {
        "verdict": "input-bound",
        "verdict_reason": "the step waits for the next batch 64% of the time & 'workers' are busy",
        "data_wait_fraction": 0.64,
        "fractions": {"data_wait": 0.64, "transfer": 0.05, "host": 0.09, "compute": 0.22},
        "steps_measured": steps, "warmup_steps": 5, "samples_per_s": 1234.5, "step_s": 0.0571,
        "timeline": _steps(steps),
        "loaders": [{"index": 0, "kind": "DataLoader", "dataset": "ImageFolder<train & val>", "num_workers": 2,
                     "pin_memory": False, "persistent_workers": False, "prefetch_factor": 2, "batch_size": 64,
                     "in_memory": False, "decode": "pil", "batches_per_epoch": 40, "batches": 65, "wait_s": 2.41,
                     "epochs": 2, "startup_s": [1.2, 0.9], "batch_bytes": 38535168, "image_hw": [224, 224]}],
        "recommendations": [
            {"id": "workers", "title": "Use more loader workers", "why": "64% of each step waits for data",
             "fix": "DataLoader(..., num_workers=8, persistent_workers=True)", "expected_gain": 1.8},
            {"id": "decode", "title": "Decode JPEGs at reduced size", "why": "images are decoded at 4x the size used",
             "fix": "ImageFolder(root, decode='draft')", "expected_gain": 1.25},
            {"id": "pin", "title": "Pin host memory", "why": "copies from pageable memory are slower",
             "fix": "DataLoader(..., pin_memory=True)", "expected_gain": None},
        ],
        "observed": {"device": "cpu", "parameters": 11_689_512, "autocast": [["cpu", "bfloat16"]], "compiled": False,
                     "syncs_per_step": 1.0, "gpu_util_mean": None, "jpeg_decoded_pixels_median": 187500.0},
        "env": {"python": "3.11.9", "torch": "2.13.0+cpu", "cuda_available": False, "cpu_count": 2,
                "cpu_affinity": 2, "cgroup_cpu_limit": None, "memory_bytes": 8 * 1024**3, "shm_bytes": 64 * 1024**2,
                "gpus": [],
                "checks": [{"name": "cpu", "status": "ok", "detail": "2 CPUs usable", "fix": ""},
                           {"name": "shm", "status": "warn", "detail": "/dev/shm is 64 MiB",
                            "fix": "docker run --shm-size=8g ..."},
                           {"name": "nvml", "status": "info", "detail": "no NVIDIA driver", "fix": ""}]},
        "monitor": {"summary": {"cpu.percent": {"mean": 41.0, "p5": 12.0, "p95": 69.0, "minimum": 10.0,
                                                "maximum": 70.0, "last": 50.0, "n": 80}},
                    "series": {"cpu.percent": cpu, "workers.cpu_percent": workers, "proc.rss_bytes": rss,
                               "workers.rss_bytes": wrss},
                    "unavailable": {"nvml": "pynvml cannot be imported <No module named 'pynvml'>"},
                    "gpu_sawtooth": {}},
        "script": {"target": "train.py", "args": ["--epochs", "2", EVIL], "outcome": "stopped after measuring",
                   "exit_code": 0},
        "notes": ["measured on CPU: transfer is a host copy", "note with <b>markup</b>"],
    }


class _Structure(HTMLParser):
    """Counts tags and collects the resource attributes of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[str, int] = {}
        self.resources: list[str] = []
        self.closed_html = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags[tag] = self.tags.get(tag, 0) + 1
        self.resources += [value or "" for name, value in attrs if name in ("src", "href", "xlink:href", "srcset")]

    def handle_endtag(self, tag: str) -> None:
        self.closed_html |= tag == "html"


def _parse(page: str) -> _Structure:
    parser = _Structure()
    parser.feed(page)
    parser.close()
    return parser


def test_full_report_is_one_complete_page_with_every_section() -> None:
    page = render_html(synthetic_report())
    assert page.lstrip().lower().startswith("<!doctype html>")
    assert page.count("<html") == 1 and page.rstrip().endswith("</html>")
    structure = _parse(page)
    assert structure.closed_html and structure.tags["body"] == 1 and structure.tags["head"] == 1
    for heading in HEADINGS:
        assert f"<h2>{heading}</h2>" in page, heading
    assert "verdict: input-bound" in page
    assert "<title>trainfast doctor — train.py</title>" in page
    for title in ("Use more loader workers", "Decode JPEGs at reduced size", "Pin host memory"):
        assert title in page
    assert "1.80x" in page and "1.25x" in page and ">?<" in page
    assert "<code>DataLoader(..., num_workers=8, persistent_workers=True)</code>" in page
    assert ">1,234<" in page  # samples/s
    assert "57.1 ms" in page
    assert "GPU: n/a (nvml: pynvml cannot be imported &lt;No module named &#x27;pynvml&#x27;&gt;)" in page
    assert "/dev/shm is 64 MiB" in page and "<details>" in page
    assert "3.11.9" in page and "2.13.0+cpu" in page
    assert structure.tags.get("svg", 0) >= 3  # timeline, CPU, memory
    assert structure.tags.get("rect", 0) >= 60  # at least one segment per step
    assert structure.tags.get("polyline", 0) == 4


def test_user_strings_are_escaped_and_nothing_is_fetched() -> None:
    page = render_html(synthetic_report())
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<script" not in page.lower()
    assert "note with &lt;b&gt;markup&lt;/b&gt;" in page
    crashed = synthetic_report(3)
    crashed["script"].update(outcome=f"the script crashed: ValueError: {EVIL}", exit_code=1,
                             error=f"Traceback (most recent call last):\nValueError: {EVIL}")
    crashed_page = render_html(crashed)
    assert "<script" not in crashed_page.lower() and "<pre>Traceback" in crashed_page
    assert "ValueError: &lt;script&gt;" in crashed_page and "(exit code 1)" in crashed_page
    assert "ImageFolder&lt;train &amp; val&gt;" in page
    assert "http://" not in page and "https://" not in page
    assert "@import" not in page and "url(" not in page
    resources = _parse(page).resources
    assert all(not re.match(r"\s*(https?:)?//", r, re.IGNORECASE) for r in resources), resources
    assert _parse(page).tags.get("link", 0) == 0 and _parse(page).tags.get("img", 0) == 0


@pytest.mark.parametrize("report", [{"verdict": None, "steps_measured": 0}, {}, {
    "verdict": "balanced", "fractions": None, "timeline": [{"total_s": None}, "junk", {"wait_s": float("nan")}],
    "loaders": [None, {"startup_s": None}], "recommendations": [{"title": None}], "observed": [], "env": {"checks": 3},
    "monitor": {"series": {"cpu.percent": [[0, 1]], "gpu0.util": "x"}, "summary": None}, "script": {"args": None},
    "notes": None, "samples_per_s": float("inf"), "step_s": "fast"}])
def test_sparse_or_odd_reports_render_with_na(report: dict[str, Any]) -> None:
    page = render_html(report)
    assert page.rstrip().endswith("</html>")
    assert "n/a" in page and "could not render" not in page
    for heading in HEADINGS:
        assert heading in page


def test_no_verdict_says_nothing_was_measured() -> None:
    page = render_html({"verdict": None, "steps_measured": 0})
    assert "verdict: n/a" in page and "no optimizer step was measured" in page
    assert "<title>trainfast doctor</title>" in page


def test_gpu_utilisation_is_charted_per_device() -> None:
    report = synthetic_report(10)
    report["monitor"]["series"]["gpu0.util"] = [[0.5 * i, 90.0 if i % 4 else 5.0] for i in range(40)]
    report["monitor"]["series"]["gpu1.util"] = [[0.5 * i, 50.0] for i in range(40)]
    report["monitor"]["gpu_sawtooth"] = {"gpu0.util": True, "gpu1.util": False}
    page = render_html(report)
    assert "GPU: n/a" not in page and "GPU0" in page and "GPU1" in page
    assert "sawtooth utilisation on gpu0.util" in page
    assert _parse(page).tags.get("polyline", 0) == 6


def test_many_steps_render_a_bounded_number_of_bars() -> None:
    page = render_html(synthetic_report(1000))
    rects = _parse(page).tags.get("rect", 0)
    assert MAX_BARS <= rects <= 4 * MAX_BARS  # >= one segment per bar, <= four
    assert "each bar averages 3 consecutive steps" in page
    assert len(page) < 1_000_000


def test_several_loaders_get_one_column_each() -> None:
    report = synthetic_report(5)
    report["loaders"].append({**report["loaders"][0], "index": 1, "dataset": "val<set>", "startup_s": []})
    page = render_html(report)
    assert "<th>#0</th><th>#1</th>" in page and "val&lt;set&gt;" in page
    assert "1.20 s, 0.90 s" in page and "37 MiB" not in page and "36.8 MiB" in page


def _chromium_or_skip() -> Path:
    if CHROMIUM.exists():
        return CHROMIUM
    message = f"{CHROMIUM} is missing; install it with: apt-get install -y chromium"
    if os.environ.get("CI"):
        pytest.fail(f"CI must install Chromium to render the HTML report: {message}")
    pytest.skip(message)


def _near(pixels: np.ndarray, colour: str, tolerance: int = 10) -> np.ndarray:
    """Which RGB pixels (shape (..., 3)) lie within `tolerance` of `colour` ("#rrggbb") on every channel."""
    rgb = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)], dtype=np.int16)
    return np.asarray(np.all(np.abs(pixels.astype(np.int16) - rgb) <= tolerance, axis=-1), dtype=bool)


@pytest.mark.slow
def test_page_renders_in_headless_chromium(tmp_path: Path) -> None:
    chromium = _chromium_or_skip()
    from PIL import Image

    page = tmp_path / "report.html"
    page.write_text(render_html(synthetic_report()), encoding="utf-8")
    shot = tmp_path / "shot.png"
    profile = tmp_path / "profile"
    command = [str(chromium), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
               f"--user-data-dir={profile}", "--window-size=1200,1600", f"--screenshot={shot}", page.as_uri()]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False,
                            env={**os.environ, "HOME": str(tmp_path)})
    assert shot.exists(), f"no screenshot (exit {result.returncode}): {result.stderr[-2000:]}"
    keep = os.environ.get("TRAINFAST_KEEP_SCREENSHOT")
    if keep:
        shutil.copy(shot, keep)
    with Image.open(shot) as image:
        assert image.size == (1200, 1600)
        pixels = np.asarray(image.convert("RGB"), dtype=np.int16).reshape(-1, 3)
    background = pixels[5 * 1200 + 5]  # top-left corner: the page background
    assert _near(background, "#f4f5f7", 3), background
    ink = ~_near(pixels, "#f4f5f7", 3) & ~_near(pixels, "#ffffff", 3)  # neither page nor card background
    assert ink.mean() > 0.03, ink.mean()
    found = {colour: int(_near(pixels, colour).sum()) for colour in
             ("#c92a2a", "#e5484d", "#c026d3", "#f59f00", "#2f9e44")}  # banner, then the four parts
    assert all(n > 200 for n in found.values()), found
