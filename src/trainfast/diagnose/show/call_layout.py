"""A call's keyword arguments appended as the call lays out its own (`with_added`), with libcst: one line stays one
line, one argument per line gets each new one on its own line at the arguments' indentation, a trailing comma and
the last argument's comment kept where they were (show/patch.py edits the script's DataLoader calls with it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import libcst as cst


def with_added(call: cst.Call, add: Mapping[str, str]) -> cst.Call:
    """`call` with keyword arguments appended, laid out like its own: on the same line for a one-line call, each on
    its own line with the arguments' indentation for a call with one argument per line, a trailing comma kept."""
    import libcst as cst

    args = list(call.args)
    # `k = v` or `k=v`, as the call already writes its keywords
    equal = next((arg.equal for arg in args if arg.keyword is not None),
                 cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")))
    new = [cst.Arg(keyword=cst.Name(k), equal=equal, value=cst.parse_expression(v)) for k, v in add.items()]
    if not args:
        for i in range(len(new) - 1):
            new[i] = new[i].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        return call.with_changes(args=new)

    last = args[-1]
    # The whitespace before the last argument is the call's separator: a new line and an indentation, or a space.
    before_last = args[-2].comma if len(args) > 1 else None
    sep: cst.BaseParenthesizableWhitespace
    if isinstance(before_last, cst.Comma):
        sep = before_last.whitespace_after
    elif isinstance(call.whitespace_before_args, cst.ParenthesizedWhitespace):
        sep = call.whitespace_before_args
    else:
        sep = cst.SimpleWhitespace(" ")
    trailing = isinstance(last.comma, cst.Comma)
    # What follows the last argument up to `)`: its line's comment, comment lines, the indentation of `)`.
    tail = last.comma.whitespace_after if isinstance(last.comma, cst.Comma) else last.whitespace_after_arg

    def between(first_line: cst.TrailingWhitespace | None = None) -> cst.BaseParenthesizableWhitespace:
        if isinstance(sep, cst.ParenthesizedWhitespace):
            return cst.ParenthesizedWhitespace(first_line=first_line or cst.TrailingWhitespace(), empty_lines=[],
                                               indent=sep.indent, last_line=sep.last_line)
        return sep

    after_last: cst.BaseParenthesizableWhitespace
    end: cst.BaseParenthesizableWhitespace
    if isinstance(tail, cst.ParenthesizedWhitespace) and isinstance(sep, cst.ParenthesizedWhitespace):
        # The last argument's comment stays on its line; the new ones go between it and the lines before `)`.
        after_last = between(tail.first_line)
        end = cst.ParenthesizedWhitespace(first_line=cst.TrailingWhitespace(), empty_lines=tail.empty_lines,
                                          indent=tail.indent, last_line=tail.last_line)
    else:
        after_last = between()
        end = tail
    if isinstance(last.comma, cst.Comma):
        args[-1] = last.with_changes(comma=last.comma.with_changes(whitespace_after=after_last))
    else:
        args[-1] = last.with_changes(comma=cst.Comma(whitespace_after=after_last),
                                     whitespace_after_arg=cst.SimpleWhitespace(""))
    for i in range(len(new) - 1):
        new[i] = new[i].with_changes(comma=cst.Comma(whitespace_after=between()))
    if trailing:
        new[-1] = new[-1].with_changes(comma=cst.Comma(whitespace_after=end))
    else:
        new[-1] = new[-1].with_changes(whitespace_after_arg=end)
    return call.with_changes(args=[*args, *new])
