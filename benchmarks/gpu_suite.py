"""The GPU measurements gpu.sh collects: precision, channels_last, torch.compile, host-to-device bandwidth.

Every section is timed with CUDA synchronisation, warm-up steps discarded, variants interleaved over
`--repeats` rounds, medians and ranges reported. A section that fails records its error and the suite
goes on: one missing kernel must not cost the whole lease. `--device cpu --tiny` runs every path on a CPU
(fp16/bf16 autocast, compile and the copies all exist there) so the script is known to run before a GPU
is ever lent.

    python benchmarks/gpu_suite.py --json gpu_suite.json
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from trainfast.atomic import write_json
from trainfast.bench.hardware import describe, hardware
from trainfast.bench.sweeps import mixed_precision
from trainfast.bench.timing import Spread, interleave, ratios
from trainfast.data.models import ConvNet
from trainfast.device import synchronize
from trainfast.trainer.step import prepare_step


def step_rate(device: torch.device, *, precision: str, channels_last: bool, compile_model: bool, widths: list[int],
              image_size: int, batch_size: int, steps: int, warmup: int) -> Callable[[], float]:
    """A closure measuring samples/s of a full training step (autocast forward, scaled backward, AdamW)."""
    torch.manual_seed(0)
    step = prepare_step(ConvNet(10, widths), device, lr=1e-3, weight_decay=0.05, precision=precision,
                        channels_last=channels_last)
    run = torch.compile(step.model) if compile_model else step.model
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(batch_size, 3, image_size, image_size, device=device).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (batch_size,), device=device)

    def one_step() -> None:
        step((x, y), model=run)

    def measure() -> float:
        for _ in range(warmup):
            one_step()
        synchronize(device)
        started = time.perf_counter()
        for _ in range(steps):
            one_step()
        synchronize(device)
        return batch_size * steps / (time.perf_counter() - started)
    return measure


def compare(variants: dict[str, Callable[[], float]], repeats: int, base: str) -> dict[str, Any]:
    rates = interleave(variants, repeats=repeats, warmup=0)
    return {name: {"samples_per_s": Spread.of(values).to_json(),
                   "speedup_vs_" + base: Spread.of(ratios(values, rates[base])).to_json()}
            for name, values in rates.items()}


def bandwidth(device: torch.device, megabytes: int, repeats: int) -> dict[str, Any]:
    """Host-to-device copy speed from pageable and from pinned memory, GB/s (median of `repeats` copies)."""
    out: dict[str, Any] = {"bytes": megabytes * 2**20}
    for kind in ("pageable", "pinned"):
        if kind == "pinned" and device.type != "cuda":
            out[kind] = {"error": "n/a: pinned memory needs CUDA"}
            continue
        host = torch.empty(megabytes * 2**20, dtype=torch.uint8, pin_memory=kind == "pinned")
        target = torch.empty_like(host, device=device)
        seconds = []
        for _ in range(repeats + 1):
            synchronize(device)
            started = time.perf_counter()
            target.copy_(host, non_blocking=kind == "pinned")
            synchronize(device)
            seconds.append(time.perf_counter() - started)
        out[kind] = {"gb_per_s": host.numel() / statistics.median(seconds[1:]) / 1e9}
    return out


def section(name: str, results: dict[str, Any], fn: Callable[[], Any]) -> None:
    started = time.perf_counter()
    print(f"== {name}", flush=True)
    try:
        results[name] = fn()
    except Exception as e:  # record it and keep the lease useful
        results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=5)}
    results[name + "_seconds"] = time.perf_counter() - started
    print(f"   {summary(results[name])}", flush=True)


def summary(result: Any) -> str:
    """One line per variant: median samples/s and the speed-up against the section's base."""
    if not isinstance(result, dict) or "error" in result:
        return str(result)
    parts = []
    for name, value in result.items():
        if isinstance(value, dict) and "samples_per_s" in value:
            speedup = next((v["median"] for k, v in value.items() if k.startswith("speedup_vs_")), None)
            parts.append(f"{name} {value['samples_per_s']['median']:,.0f} samples/s ({speedup:.2f}x)")
        elif isinstance(value, dict) and "gb_per_s" in value:
            parts.append(f"{name} {value['gb_per_s']:.1f} GB/s")
        elif isinstance(value, (int, float)) and name != "bytes":
            parts.append(f"{name} {value:.1f}")
        elif isinstance(value, dict) and "error" in value:
            parts.append(f"{name}: {value['error']}")
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="small sizes: prove every path runs (CPU smoke test)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.tiny:
        size: dict[str, Any] = {"widths": [8, 16], "image_size": 16, "batch_size": 8, "steps": 3, "warmup": 1}
        megabytes, repeats = 4, 1
    else:  # an airbench-sized ConvNet at 64 px: large enough that the GPU, not launches, sets the pace
        size = {"widths": [64, 128, 256, 512], "image_size": 64, "batch_size": 256, "steps": 30, "warmup": 10}
        megabytes, repeats = 512, args.repeats
    mixed = mixed_precision(device)  # from the target device's capability, not the current device's
    results: dict[str, Any] = {"device": str(device), "sizes": size, "hardware": hardware()}
    print(describe(results["hardware"]), flush=True)

    def rate(precision: str, channels_last: bool = False, compile_model: bool = False) -> Callable[[], float]:
        return step_rate(device, precision=precision, channels_last=channels_last, compile_model=compile_model,
                         **size)

    section("precision", results, lambda: compare(
        {"32-true": rate("32-true"), "bf16-mixed": rate("bf16-mixed"), "16-mixed": rate("16-mixed")},
        repeats, "32-true"))
    section("channels_last", results, lambda: compare(
        {"nchw": rate(mixed), "channels_last": rate(mixed, channels_last=True)}, repeats, "nchw"))

    def compiled() -> dict[str, Any]:
        started = time.perf_counter()
        compiled_rate = rate(mixed, channels_last=True, compile_model=True)
        first = compiled_rate()  # includes compilation
        compile_s = time.perf_counter() - started
        table = compare({"eager": rate(mixed, channels_last=True), "compiled": compiled_rate}, repeats, "eager")
        return table | {"first_run_seconds_with_compilation": compile_s, "first_run_samples_per_s": first}
    section("compile", results, compiled)
    section("h2d_bandwidth", results, lambda: bandwidth(device, megabytes, repeats * 3))
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
