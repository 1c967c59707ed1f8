"""The collectives a job issued, in words."""

from __future__ import annotations

from typing import Any


def collective_words(kinds: Any) -> str:
    """'the all-reduce', 'the all-gathers and reduce-scatters': the collectives a job issued, for the report's text
    (`kinds`: their names, or an `observed["collectives"]["kinds"]` mapping); 'the collectives' when none is known."""
    names = [k for k in kinds if k != "barrier"] if kinds else []
    if not names:
        return "the collectives"
    if len(names) == 1:
        return f"the {names[0]}"
    plural = [f"{n}s" for n in names]
    return f"the {', '.join(plural[:-1])} and {plural[-1]}"
