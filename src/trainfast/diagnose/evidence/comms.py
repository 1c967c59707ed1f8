"""The collectives a job issued, as the rules read them (`Collectives`: which kinds, under which wrapper), and in
words for the report's text."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Collectives:
    """The collectives across ranks over the measured steps (capture/comms.py `collectives_json` has the figures)."""

    kinds: tuple[str, ...]  # the kinds issued, most frequent first: "all-reduce", "all-gather", ...
    wrappers: tuple[str, ...]  # the data-parallel wrappers seen: "ddp", "fsdp2", "fsdp"
    bucket_view: bool | None  # a DDP model's gradient_as_bucket_view

    @classmethod
    def of(cls, figures: Mapping[str, Any] | None) -> Collectives | None:
        """From the capture's figures; None where no collective was seen."""
        if not figures:
            return None
        return cls(kinds=tuple(figures.get("kinds") or {}), wrappers=tuple(figures.get("wrappers") or ()),
                   bucket_view=figures.get("ddp_gradient_as_bucket_view"))


def collective_words(kinds: Iterable[str] | None) -> str:
    """'the all-reduce', 'the all-gathers and reduce-scatters': the collectives a job issued, for the report's text
    (`kinds`: their names, or an `observed["collectives"]["kinds"]` mapping); 'the collectives' when none is known."""
    names = [k for k in kinds if k != "barrier"] if kinds else []
    if not names:
        return "the collectives"
    if len(names) == 1:
        return f"the {names[0]}"
    plural = [f"{n}s" for n in names]
    return f"the {', '.join(plural[:-1])} and {plural[-1]}"
