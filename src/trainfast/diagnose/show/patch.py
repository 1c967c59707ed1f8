"""A unified diff that makes the doctor's keyword fixes permanent in the user's script (`trainfast doctor --patch`).

The doctor knows, for a fix such as `num_workers`, the file and line where the script called `DataLoader(...)` and
the keyword arguments the fix sets. `keyword_patch` edits those calls and returns a diff that `git apply` and
`patch -p1` take, with what it changed and what it left alone (and why) for the terminal.

The calls are found and edited with libcst, not with regular expressions: libcst parses the file into a concrete
syntax tree that keeps every space, comment and line ending, so only the argument list of the call that ran
changes and everything else comes back byte for byte; a regular expression cannot tell a call from a comment or a
string that mentions it, nor find where a multi-line call ends. libcst is imported on first use, so importing
this module stays fast.

It never writes the user's file and never raises for it: a file that is outside the root, unreadable or does not
parse, a call that is not there any more, or a keyword the script computes itself (`num_workers=args.workers`)
gives a line in `skipped` saying what to do by hand. A call is edited all or nothing: half a fix (say
`persistent_workers=True` added while `num_workers` stays the script's own, possibly 0) could be invalid.
"""

from __future__ import annotations

import ast
import keyword as py_keyword
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from trainfast.diagnose.show.call_layout import with_added
from trainfast.diagnose.show.unified_diff import unified_diff

if TYPE_CHECKING:
    import libcst as cst

Value = bool | int | float | str | None

# DataLoader's parameters that can be passed by position, in order: adding one as a keyword when the call already
# passes it by position would raise "got multiple values for argument".
POSITIONAL_PARAMETERS: dict[str, tuple[str, ...]] = {
    "DataLoader": (
        "dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "num_workers", "collate_fn", "pin_memory",
        "drop_last", "timeout", "worker_init_fn", "multiprocessing_context", "generator",
    ),
}

_SHOWN_EXPRESSION = 60  # characters of the script's own expression quoted in a reason


@dataclass(frozen=True)
class KeywordEdit:
    """One fix's keyword arguments for the call at `file:line` (the frame's line while the call ran)."""

    fix_id: str  # e.g. "num_workers"
    file: str  # absolute path of the user's source file
    line: int  # 1-based line of the call
    callee: str  # the callee's last name part: "DataLoader" for DataLoader(...), torch.utils.data.DataLoader(...)
    keywords: Mapping[str, Value]  # e.g. {"num_workers": 4, "persistent_workers": True}


@dataclass(frozen=True)
class KeywordPatch:
    """The diff (paths `a/REL`, `b/REL` relative to the root; "" when nothing changed), one line per call changed
    and one line per edit not made."""

    diff: str
    changed: list[str]
    skipped: list[str]


def keyword_patch(edits: Sequence[KeywordEdit], *, root: Path) -> KeywordPatch:
    """The unified diff that makes `edits` in their files under `root`; the files themselves are only read.

    Edits on one file give one section, the files sorted by path. Edits on one call are merged; when two set one
    keyword to different values, the first wins and the second is skipped. `skipped` follows the order of `edits`.
    The diff keeps each file's line endings: write it as is (`newline=""`), not through a newline translation.
    """
    root_dir = root.resolve()
    skipped: list[tuple[int, str]] = []
    by_file: dict[str, list[tuple[int, KeywordEdit]]] = {}
    for index, edit in enumerate(edits):
        try:
            rel = Path(edit.file).resolve().relative_to(root_dir).as_posix()
        except (ValueError, OSError, RuntimeError):
            skipped.append((index, f"{edit.file}:{edit.line}: not under {root_dir}, the folder the patch is for: "
                                   f"set {_settings(edit.keywords)} there by hand{_not_made(edit)}"))
            continue
        by_file.setdefault(rel, []).append((index, edit))
    sections: list[str] = []
    changed: list[str] = []
    for rel in sorted(by_file):
        result = _patch_file(root_dir / rel, rel, by_file[rel])
        sections.append(result.diff)
        changed += result.changed
        skipped += result.skipped
    skipped.sort(key=lambda item: item[0])
    return KeywordPatch(diff="".join(sections), changed=changed, skipped=[reason for _, reason in skipped])


@dataclass
class _FileResult:
    diff: str = ""
    changed: list[str] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class _CallPlan:
    """What one call gets: keyword -> Python source of the value, replaced in place or added at the end."""

    callee: str
    replace: dict[str, str] = field(default_factory=dict)
    add: dict[str, str] = field(default_factory=dict)


def _patch_file(path: Path, rel: str, edits: list[tuple[int, KeywordEdit]]) -> _FileResult:
    import libcst as cst
    from libcst.metadata import MetadataWrapper, PositionProvider

    result = _FileResult()

    def skip_all(why: str) -> _FileResult:
        result.skipped += [(index, f"{rel}:{edit.line}: {why}: set {_settings(edit.keywords)} by hand{_not_made(edit)}")
                           for index, edit in edits]
        return result

    try:
        source = path.read_bytes()
    except OSError as exc:
        return skip_all(f"cannot read the file ({exc.strerror or exc})")
    try:
        text = source.decode("utf-8")
    except UnicodeDecodeError:
        # The diff is text in UTF-8: for a file in another encoding it would not apply.
        return skip_all("the file is not UTF-8, so a patch for it would not apply")
    try:
        module = cst.parse_module(text)
    except Exception as exc:  # a user's file: any failure to parse it is a reason, never a crash
        return skip_all(f"the file does not parse ({_first_line(str(exc)) or type(exc).__name__})")
    if module.code != text:  # libcst round-trips every file it parses; if not, a diff would rewrite more than the call
        return skip_all("the file does not read back unchanged through libcst")
    positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    calls = [(node, span.start.line, span.end.line) for node, span in positions.items() if isinstance(node, cst.Call)]

    # Each edit to its call: the innermost call of that name whose lines hold the edit's line.
    on_call: dict[int, tuple[cst.Call, int, list[tuple[int, KeywordEdit]]]] = {}
    for index, edit in edits:
        where = f"{rel}:{edit.line}"
        problem = _bad_edit(edit)
        if problem:
            result.skipped.append((index, f"{where}: {problem}{_not_made(edit)}"))
            continue
        name = edit.callee.rpartition(".")[2]
        found = [(node, start, end) for node, start, end in calls
                 if start <= edit.line <= end and _callee_name(node) == name]
        innermost = [c for c in found if not any(o is not c and _contains(c, o) for o in found)]
        if len(innermost) != 1:
            why = (f"no {name}(...) call at this line (the file may have changed since the report)" if not innermost
                   else f"{len(innermost)} {name}(...) calls at this line, so which one ran is not known")
            result.skipped.append((index, f"{where}: {why}: set {_settings(edit.keywords)} in the call by hand"
                                          f"{_not_made(edit)}"))
            continue
        node, start, _ = innermost[0]
        on_call.setdefault(id(node), (node, start, []))[2].append((index, edit))

    plans: dict[int, _CallPlan] = {}
    for key, (node, start, call_edits) in sorted(on_call.items(), key=lambda item: item[1][1]):
        plan, notes, skips = _plan_call(module, node, start, rel, call_edits)
        result.skipped += skips
        if plan is not None and (plan.replace or plan.add):
            plans[key] = plan
            result.changed.append(notes)
    if not plans:
        return result
    new_text = module.visit(_editor(plans)).code
    result.diff = unified_diff(text, new_text, rel)
    return result


def _plan_call(
    module: cst.Module, call: cst.Call, line: int, rel: str, edits: list[tuple[int, KeywordEdit]]
) -> tuple[_CallPlan | None, str, list[tuple[int, str]]]:
    """The edits on one call merged into one plan, the line for `changed`, and the edits skipped."""
    where = f"{rel}:{line}"
    skips: list[tuple[int, str]] = []
    wanted: dict[str, Value] = {}
    setter: dict[str, str] = {}  # keyword -> the first fix that set it
    kept: list[tuple[int, KeywordEdit]] = []
    for index, edit in edits:
        clash = [k for k, v in edit.keywords.items() if k in wanted and not _same(wanted[k], v)]
        if clash:
            k = clash[0]
            skips.append((index, f"{where}: fix {edit.fix_id} sets {k}={_code(edit.keywords[k])} but fix {setter[k]} "
                                 f"sets {k}={_code(wanted[k])} in the same call, and the first is kept: "
                                 f"choose by hand{_not_made(edit)}"))
            continue
        for k, v in edit.keywords.items():
            wanted.setdefault(k, v)
            setter.setdefault(k, edit.fix_id)
        kept.append((index, edit))

    existing = {arg.keyword.value: arg for arg in call.args if arg.keyword is not None}
    positional = [arg for arg in call.args if arg.keyword is None and not arg.star]
    by_position = POSITIONAL_PARAMETERS.get(_callee_name(call) or "", ())
    plan = _CallPlan(callee=kept[0][1].callee if kept else "")
    problems: list[str] = []
    notes: list[str] = []
    for k, v in wanted.items():
        new = _code(v)
        if k in existing:
            old_node = existing[k].value
            old = _literal(module, old_node)
            if old is None:
                shown = _shown(module.code_for_node(old_node))
                problems.append(f"{k}={shown} is the script's own setting: give it {new} where {shown} comes from "
                                f"(a flag or config)")
            elif not _same(old[0], v):
                plan.replace[k] = new
                notes.append(f"{k}={_shown(module.code_for_node(old_node))} -> {new}")
        elif any(arg.star == "**" for arg in call.args):
            problems.append(f"the call passes **{_shown(_star_name(module, call, '**'))}, which may already set {k}: "
                            f"set {k}={new} there or in the call by hand")
        elif any(arg.star == "*" for arg in call.args) and (k in by_position or not by_position):
            problems.append(f"the call passes *{_shown(_star_name(module, call, '*'))}, which may already set {k} "
                            f"by position: set {k}={new} by hand")
        elif k in by_position and by_position.index(k) < len(positional):
            problems.append(f"{k} is passed by position (argument {by_position.index(k) + 1}): "
                            f"give it {new} there by hand")
        else:
            plan.add[k] = new
            notes.append(f"{k}={new} (added)")
    if problems:  # all or nothing: a fix half made could be invalid
        reason = "; ".join(problems)
        skips += [(index, f"{where}: {reason}{_not_made(edit)}") for index, edit in kept]
        return None, "", skips
    # every fix the change makes, a second fix that asks for the same value included
    fixes = list(dict.fromkeys(edit.fix_id for _, edit in kept if any(k in plan.replace or k in plan.add
                                                                        for k in edit.keywords)))
    label = "fix" if len(fixes) == 1 else "fixes"
    return plan, f"{where} {plan.callee}(...): {', '.join(notes)} [{label} {', '.join(fixes)}]", skips


def _editor(plans: dict[int, _CallPlan]) -> cst.CSTTransformer:
    """The transformer that applies the plans to the calls they are keyed by (`id` of the parsed node)."""
    import libcst as cst

    class Editor(cst.CSTTransformer):
        def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
            plan = plans.get(id(original_node))
            if plan is None:
                return updated_node
            args = [
                arg.with_changes(value=cst.parse_expression(plan.replace[arg.keyword.value]))
                if arg.keyword is not None and arg.keyword.value in plan.replace else arg
                for arg in updated_node.args
            ]
            call = updated_node.with_changes(args=args)
            return with_added(call, plan.add) if plan.add else call

    return Editor()


def _callee_name(call: cst.Call) -> str | None:
    """The callee's last name part: `DataLoader` for `DataLoader`, `data.DataLoader`, `torch.utils.data.DataLoader`."""
    import libcst as cst

    if isinstance(call.func, cst.Name):
        return call.func.value
    if isinstance(call.func, cst.Attribute):
        return call.func.attr.value
    return None


def _contains(outer: tuple[cst.Call, int, int], inner: tuple[cst.Call, int, int]) -> bool:
    """Whether the call `inner` is inside the call `outer` (a descendant of it in the tree)."""
    import libcst as cst

    if not (outer[1] <= inner[1] and inner[2] <= outer[2]):
        return False
    target = inner[0]

    class Finder(cst.CSTVisitor):
        found = False

        def on_visit(self, node: cst.CSTNode) -> bool:
            if node is target:
                self.found = True
            return not self.found

    finder = Finder()
    outer[0].visit(finder)
    return finder.found and outer[0] is not target


def _literal(module: cst.Module, node: cst.BaseExpression) -> tuple[object] | None:
    """`(value,)` when `node` is a literal (a number, a string, True, False, None), else None: a name, an attribute,
    a call or any other expression is the script's own setting."""
    import libcst as cst

    number = (cst.Integer, cst.Float)
    plain = (
        isinstance(node, (*number, cst.SimpleString, cst.ConcatenatedString))
        or (isinstance(node, cst.Name) and node.value in ("True", "False", "None"))
        or (isinstance(node, cst.UnaryOperation) and isinstance(node.operator, (cst.Minus, cst.Plus))
            and isinstance(node.expression, number))
    )
    if not plain:
        return None
    try:  # literal_eval also refuses an f-string inside a concatenation
        return (ast.literal_eval(module.code_for_node(node).strip()),)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _same(a: object, b: object) -> bool:
    """Equal as settings: 4 == 4.0, but True is not 1."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def _code(value: object) -> str:
    """The Python literal for a keyword's value."""
    return repr(value)


def _bad_edit(edit: KeywordEdit) -> str | None:
    for k, v in edit.keywords.items():
        if not isinstance(k, str) or not k.isidentifier() or py_keyword.iskeyword(k):
            return f"{k!r} is not a keyword argument's name"
        if isinstance(v, float) and not math.isfinite(v):
            return f"{k}={v!r} cannot be written as a Python literal: set it by hand"
        if v is not None and not isinstance(v, (bool, int, float, str)):
            return f"{k}={v!r} is not a number, a string, True, False or None: set it by hand"
    return None


def _star_name(module: cst.Module, call: cst.Call, star: str) -> str:
    return next(module.code_for_node(arg.value) for arg in call.args if arg.star == star)


def _shown(code: str) -> str:
    """An expression on one line, cut short: it goes into a one-line reason."""
    flat = " ".join(code.split())
    return flat if len(flat) <= _SHOWN_EXPRESSION else flat[: _SHOWN_EXPRESSION - 3] + "..."


def _settings(keywords: Mapping[str, Value]) -> str:
    return ", ".join(f"{k}={_code(v)}" for k, v in keywords.items())


def _not_made(edit: KeywordEdit) -> str:
    return f" (fix {edit.fix_id} not made)"


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")
