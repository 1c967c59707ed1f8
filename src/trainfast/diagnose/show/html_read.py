"""Reading a report defensively for the HTML page: every field may be missing, None or of an odd type (the JSON may
come from an older or a failed run), and what cannot be shown reads "n/a"; and the small pieces of markup the
sections share."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from trainfast.diagnose.show.svg import escape
from trainfast.units import format_bytes

NA = "n/a"


def _dict(value: object) -> dict[str, Any]:
    return {str(k): v for k, v in value.items()} if isinstance(value, Mapping) else {}


def _list(value: object) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else []


def _num(value: object) -> float | None:
    """A finite float, or None for anything else (None, strings, NaN, booleans)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _fmt(value: object, spec: str = ",.2f", suffix: str = "") -> str:
    number = _num(value)
    return NA if number is None else f"{number:{spec}}{suffix}"


def _value(value: object) -> str:
    """A free-form fact (observed, env, loader) as short text, not yet escaped."""
    if value is None:
        return NA
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return NA if not math.isfinite(value) else f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, (list, tuple)):
        if not value:
            return "none"
        return ", ".join("/".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v) for v in value)
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "none"
    return str(value)


def _bytes(value: object) -> str:
    number = _num(value)
    if number is None:
        return NA
    return format_bytes(number)


def _legend(items: Iterable[tuple[str, str]]) -> str:
    return ('<div class="legend">' + "".join(f'<span><span class="swatch" style="background:{colour}"></span>'
                                             f"{text}</span>" for text, colour in items) + "</div>")


def _table(headers: Sequence[str], rows: Iterable[Sequence[tuple[str, bool]]]) -> str:
    """An HTML table; each cell is (already escaped html, numeric?)."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f'<td class="num">{c}</td>' if num else f"<td>{c}</td>" for c, num in row)
                   + "</tr>" for row in rows)
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _kv_tables(items: Sequence[tuple[str, str]]) -> str:
    """Key/value pairs (escaped) as two side-by-side tables."""
    half = math.ceil(len(items) / 2)
    tables = ["<table><tbody>" + "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in chunk) +
              "</tbody></table>" for chunk in (items[:half], items[half:]) if chunk]
    return f'<div class="kv">{"".join(tables)}</div>'


def _ms(value: object) -> str:
    seconds = _num(value)
    return NA if seconds is None else f"{1e3 * seconds:,.1f} ms"
