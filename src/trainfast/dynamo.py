"""torch._dynamo's process-wide counters (frames compiled, graph breaks), read without importing dynamo when
nothing has loaded it: importing it costs about a second."""

from __future__ import annotations

import sys


def dynamo_counts() -> dict[str, int]:
    """Frames compiled and graph breaks so far (zero if dynamo never loaded)."""
    if "torch._dynamo" not in sys.modules:
        return {"frames": 0, "graph_breaks": 0}
    from torch._dynamo.utils import counters

    return {"frames": int(counters["frames"].get("ok", 0)), "graph_breaks": int(sum(counters["graph_break"].values()))}
