"""A unified diff as git writes it (`unified_diff`): `diff --git` and `---`/`+++` headers with git's quoting of
names, hunks from difflib with each line's own ending kept ("\r\n" stays), and "\\ No newline at end of file"
where a file ends without one: what `git apply` and `patch -p1` take (show/patch.py writes its edits with it)."""

from __future__ import annotations

import difflib


def _lines(text: str) -> list[str]:
    """The lines as git sees them: split at "\\n" only, each keeping its ending ("\\r\\n" stays whole)."""
    parts = text.split("\n")
    lines = [part + "\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def unified_diff(old: str, new: str, rel: str) -> str:
    """The diff from `old` to `new` of the file at `rel` (relative to the folder `git apply` runs in)."""
    a, b = _git_path("a/" + rel), _git_path("b/" + rel)
    # git ends a name that holds a space with a tab in the ---/+++ lines, so that the name's end is not a guess.
    tab = "\t" if " " in rel else ""
    out = [f"diff --git {a} {b}\n", f"--- {a}{tab}\n", f"+++ {b}{tab}\n"]
    hunks = difflib.unified_diff(_lines(old), _lines(new), n=3)
    for i, line in enumerate(hunks):
        if i < 2:  # difflib's own ---/+++ lines, written above with git's names
            continue
        out.append(line)
        if not line.endswith("\n"):  # the file's last line, without a newline
            out.append("\n\\ No newline at end of file\n")
    return "".join(out)


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\a": "\\a", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\v": "\\v", "\f": "\\f",
            "\r": "\\r"}


def _git_path(path: str) -> str:
    """A path as git writes it in a diff: in C quotes, UTF-8 bytes in octal, when it holds a quote, a backslash, a
    control or a non-ASCII character (`git apply` reads that form back)."""
    if not any(ch in _ESCAPES or ord(ch) < 0x20 or ord(ch) >= 0x7F for ch in path):
        return path
    out = []
    for byte in path.encode("utf-8", "surrogateescape"):
        ch = chr(byte)
        out.append(_ESCAPES.get(ch) or (f"\\{byte:03o}" if byte < 0x20 or byte >= 0x7F else ch))
    return '"' + "".join(out) + '"'
