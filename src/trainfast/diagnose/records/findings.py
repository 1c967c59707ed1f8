"""What the doctor concludes: the verdict, the fixes it proposes and the notes that qualify them.

A fix's `expected_gain` is the throughput ratio after the fix (1.8 = 1.8x the samples/s); None where no honest figure
exists. Its `gain_basis` says where it comes from:
- "measured": every factor in it was timed in this run: the step's own split (data wait, host, startup), or the
  candidate replayed on the script's own model and input (capture/probe.py: a precision, a layout, a thread count);
- "verified": `--verify` re-ran the script with the fix (report/verify.py sets it);
- "estimate": a factor from elsewhere (a named constant beside its rule, with its source), with `basis_reason` saying
  why nothing was measured. An estimate never outranks a measurement (fixes/rule.py `rank`), and a candidate measured
  no faster is not offered at all (fixes/notes.py says so in a note).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Verdict:
    name: str
    reason: str


@dataclass(frozen=True)
class Where:
    """Where a fix is made permanent (fixes/where.py): the file and line of the script's own code that made (or
    called) what the fix changes, that code, what it is, and where a framework made it on the script's behalf (or
    called that code), that framework and its own setting for the fix (`setting`)."""

    what: str  # a capture Site's `what`: "loader", "model", "to", "forward", "evaluation", "autocast", "save"
    file: str | None
    line: int | None
    code: str = ""
    framework: str | None = None
    setting: str | None = None

    def to_json(self) -> dict[str, object]:
        return {"what": self.what, "file": self.file, "line": self.line, "code": self.code,
                "framework": self.framework, "setting": self.setting}


@dataclass(frozen=True)
class Recommendation:
    id: str
    title: str
    why: str
    fix: str
    expected_gain: float | None
    # What `trainfast doctor --verify` injects to measure the fix without editing the script (None: it can't):
    # DataLoader keyword arguments (num_workers, pin_memory, persistent_workers, prefetch_factor) and
    # "threads" (intra-op threads), "cudnn_benchmark", "tf32", "autocast" (false: the script's autocast off).
    overrides: dict[str, Any] | None = field(default=None, compare=False)
    measured_gain: float | None = None  # samples/s with the fix / without it, both re-run (--verify)
    gain_basis: str = "estimate"  # "measured", "verified" or "estimate" (module doc)
    basis_reason: str | None = None  # an estimate's: why nothing was measured
    # `doctor --whole-run`: the gain on the whole run's wall time (Amdahl on the phase's share: fixes/run.py)
    run_gain: float | None = None
    where: Where | None = field(default=None, compare=False)  # where to make it permanent (fixes/where.py)
    # What the fix is known to change in what the model trains on, in words (more loader workers never see what the
    # loop sets on the dataset: fixes/input.py `unseen_by_workers`); --verify then keeps it out of the set and
    # `trainfast run --apply` applies it only when named (report/verify_gains.py)
    changes_training: str | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Recommendation:
        """A fix from its JSON (`to_json`): another rank's, in a torchrun job's report (gains as rounded there)."""
        return cls(id=data["id"], title=data["title"], why=data["why"], fix=data["fix"],
                   expected_gain=data.get("expected_gain"), overrides=data.get("overrides"),
                   measured_gain=data.get("measured_gain"), gain_basis=data.get("gain_basis") or "estimate",
                   basis_reason=data.get("gain_basis_reason"), run_gain=data.get("run_gain"),
                   where=Where(**data["where"]) if data.get("where") else None,
                   changes_training=data.get("changes_training"))

    def to_json(self) -> dict[str, object]:
        return {"id": self.id, "title": self.title, "why": self.why, "fix": self.fix,
                "expected_gain": None if self.expected_gain is None else round(self.expected_gain, 3),
                "measured_gain": None if self.measured_gain is None else round(self.measured_gain, 3),
                "run_gain": None if self.run_gain is None else round(self.run_gain, 3),
                "gain_basis": self.gain_basis, "gain_basis_reason": self.basis_reason,
                "overrides": self.overrides, "where": None if self.where is None else self.where.to_json(),
                "changes_training": self.changes_training}


TOPICS = ("measurement", "noise", "fixes", "job")


class Note(str):
    """One of the report's notes, with what it is about (`topic`): "measurement" (what was measured, or left out of
    the figures, and how), "noise" (how far the figures can be trusted), "fixes" (what was not offered, and why),
    "job" (a torchrun job's ranks). A `str`, the text: the report's JSON lists the texts."""

    topic: str

    def __new__(cls, text: str, topic: str) -> Note:
        if topic not in TOPICS:
            raise ValueError(f"note topic {topic!r}: one of {', '.join(TOPICS)}")
        note = super().__new__(cls, text)
        note.topic = topic
        return note
