"""A whole run's figures as TensorBoard scalars."""

from __future__ import annotations

from typing import Any


def scalars(whole: dict[str, Any]) -> list[tuple[int, dict[str, float | None]]]:
    """The whole run as TensorBoard scalars, (step, {tag: value}): each throughput interval at the count of steps
    ended by then (samples/s, the step's split per step), then the phases' seconds and shares and the goodput at the
    last step."""
    out: list[tuple[int, dict[str, float | None]]] = []
    steps = 0
    for interval in whole["throughput"]:
        steps += interval["steps"]
        out.append((steps, {"throughput/samples_per_s": interval["samples_per_s"],
                            **{f"step/{part}": interval[part]
                               for part in ("data_wait_s", "transfer_s", "host_s", "compute_s")}}))
    phases: dict[str, float | None] = {"run/goodput": whole["goodput"], "run/wall_s": whole["wall_s"]}
    for p in whole["phases"]:
        phases[f"phases/{p['phase']}_s"] = p["seconds"]
        phases[f"phases/{p['phase']}_share"] = p["share"]
    out.append((steps, phases))
    return out
