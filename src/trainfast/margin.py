"""The one margin a measured choice must clear: "faster" means at least 3 % faster.

Two runs of the same step on this machine class differ by ~3 % (a 2-core shared machine: the tuner's confirmation
runs, the Trainer's A/Bs and the doctor's replays all saw it), so a smaller gain is not told apart from none. The
doctor's candidate fixes (`diagnose/capture/probe.py`), the Trainer's A/Bs (`trainer/practice_kinds.py`) and the tuner
(`tune/confirm.py`, `tune/search.py`) all decide with it: a setting is kept over the plain default only when it
measured at least `FASTER` times as fast, and two settings within `1 - 1 / FASTER` of each other count as equal.
"""

from __future__ import annotations

FASTER = 1.03  # a ratio of speeds (new / old): at least this much faster counts as faster
WITHIN = FASTER - 1  # 0.03: settings this close (as a share of the faster one's rate) count as equally fast


def faster(ratio: float) -> bool:
    """`ratio` (the candidate's speed over the base's) clears the margin."""
    return ratio >= FASTER


__all__ = ["FASTER", "WITHIN", "faster"]
