"""`keyword_patch`: the unified diff that makes the doctor's DataLoader keyword fixes permanent, written with libcst.

Each test writes a small script into tmp_path, asks for the patch and checks the diff by applying it (with the same
hunk logic `git apply` uses, or with `git apply` itself) and comparing the result with the expected source exactly:
comments and formatting kept byte for byte, only the call's arguments changed.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

from trainfast.diagnose.show.patch import KeywordEdit, KeywordPatch, keyword_patch

Value = bool | int | float | str | None


def edit(path: Path, line: int, fix_id: str = "num_workers", callee: str = "DataLoader",
         **keywords: Value) -> KeywordEdit:
    return KeywordEdit(fix_id=fix_id, file=str(path), line=line, callee=callee, keywords=keywords)


def write(root: Path, name: str, source: str) -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(source.encode("utf-8"))
    return path


def applied(source: str, diff: str) -> str:
    """`source` with the one-file `diff` applied, hunk by hunk, checking every context and removed line."""
    lines = _git_lines(source)
    body = _git_lines(diff)
    assert body[0].startswith("diff --git ") and body[1].startswith("--- ") and body[2].startswith("+++ ")
    out: list[str] = []
    at = 0  # lines of `source` consumed
    i = 3
    while i < len(body):
        header = body[i]
        assert header.startswith("@@ -"), header
        first, _, count = header.split(" ")[1][1:].partition(",")
        start = int(first) if count == "0" else int(first) - 1  # "-N,0" is an insertion after line N
        out += lines[at:start]
        at = start
        i += 1
        while i < len(body) and not body[i].startswith("@@ "):
            kind, text = body[i][0], body[i][1:]
            if i + 1 < len(body) and body[i + 1].startswith("\\ No newline at end of file"):
                text = text[:-1]
                i += 1
            if kind in " -":
                assert lines[at] == text, (lines[at], text)
                at += 1
            if kind in " +":
                out.append(text)
            i += 1
    return "".join(out + lines[at:])


def _git_lines(text: str) -> list[str]:
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def patched(tmp_path: Path, source: str, *edits_at: tuple[int, Mapping[str, Value]]) -> tuple[str, KeywordPatch]:
    path = write(tmp_path, "train.py", source)
    patch = keyword_patch([KeywordEdit("num_workers", str(path), line, "DataLoader", kw) for line, kw in edits_at],
                          root=tmp_path)
    return (applied(source, patch.diff) if patch.diff else source), patch


def test_a_one_line_call_gets_its_literal_replaced_and_the_new_keyword_on_the_same_line(tmp_path: Path) -> None:
    source = (
        "import torch\n"
        "\n"
        "# DataLoader(ds, num_workers=0) in a comment is not a call\n"
        'note = "DataLoader(ds, num_workers=0)"\n'
        "loader = torch.utils.data.DataLoader(ds, batch_size=32, num_workers=0)  # keep me\n"
        "for x in loader:  pass   # odd spacing kept\n"
    )
    result, patch = patched(tmp_path, source, (5, {"num_workers": 4, "persistent_workers": True}))
    assert result == source.replace(
        "DataLoader(ds, batch_size=32, num_workers=0)",
        "DataLoader(ds, batch_size=32, num_workers=4, persistent_workers=True)",
    )
    assert patch.changed == [
        "train.py:5 DataLoader(...): num_workers=0 -> 4, persistent_workers=True (added) [fix num_workers]"
    ]
    assert patch.skipped == []
    assert patch.diff.startswith("diff --git a/train.py b/train.py\n--- a/train.py\n+++ b/train.py\n@@ ")
    changes = [line for line in patch.diff.splitlines()[3:] if line[:1] in "+-"]
    assert changes == [
        "-loader = torch.utils.data.DataLoader(ds, batch_size=32, num_workers=0)  # keep me",
        "+loader = torch.utils.data.DataLoader(ds, batch_size=32, num_workers=4, persistent_workers=True)  # keep me",
    ]


@pytest.mark.parametrize(
    ("old", "wanted", "new"),
    [
        ("num_workers=0", {"num_workers": 8}, "num_workers=8"),
        ("timeout=0.5", {"timeout": 2.0}, "timeout=2.0"),
        ("timeout=-1", {"timeout": 30}, "timeout=30"),
        ("pin_memory=False", {"pin_memory": True}, "pin_memory=True"),
        ("pin_memory=1", {"pin_memory": True}, "pin_memory=True"),  # True is not 1 as a setting
        ("prefetch_factor=None", {"prefetch_factor": 4}, "prefetch_factor=4"),
        ("prefetch_factor=2", {"prefetch_factor": None}, "prefetch_factor=None"),
        ("multiprocessing_context='fork'", {"multiprocessing_context": "spawn"}, "multiprocessing_context='spawn'"),
        ('multiprocessing_context="fork"', {"multiprocessing_context": "it's"}, 'multiprocessing_context="it\'s"'),
        ("num_workers=(0)", {"num_workers": 4}, "num_workers=4"),
    ],
)
def test_every_kind_of_literal_is_replaced_with_the_value_written_as_a_python_literal(
    tmp_path: Path, old: str, wanted: dict[str, Value], new: str
) -> None:
    source = f"loader = DataLoader(ds, {old})\n"
    result, patch = patched(tmp_path, source, (1, wanted))
    assert result == f"loader = DataLoader(ds, {new})\n"
    assert len(patch.changed) == 1 and patch.skipped == []


def test_a_call_with_one_argument_per_line_gets_each_new_one_on_its_own_line_with_a_trailing_comma(
    tmp_path: Path,
) -> None:
    source = (
        "def main():\n"
        "    loader = data.DataLoader(  # the training loader\n"
        "        ds,\n"
        "        batch_size=64,  # big\n"
        "        num_workers=0,\n"
        "        # pin_memory=True,\n"
        "    )\n"
    )
    result, patch = patched(tmp_path, source, (2, {"num_workers": 4, "persistent_workers": True, "prefetch_factor": 4}))
    assert result == (
        "def main():\n"
        "    loader = data.DataLoader(  # the training loader\n"
        "        ds,\n"
        "        batch_size=64,  # big\n"
        "        num_workers=4,\n"
        "        persistent_workers=True,\n"
        "        prefetch_factor=4,\n"
        "        # pin_memory=True,\n"
        "    )\n"
    )
    assert patch.changed == ["train.py:2 DataLoader(...): num_workers=0 -> 4, persistent_workers=True (added), "
                             "prefetch_factor=4 (added) [fix num_workers]"]


def test_without_a_trailing_comma_the_last_argument_keeps_its_comment_and_none_is_added_at_the_end(
    tmp_path: Path,
) -> None:
    source = (
        "loader = DataLoader(\n"
        "    ds,\n"
        "    batch_size = 64,\n"
        "    shuffle=True  # shuffled\n"
        ")\n"
    )
    result, _ = patched(tmp_path, source, (1, {"num_workers": 4, "pin_memory": True}))
    assert result == (
        "loader = DataLoader(\n"
        "    ds,\n"
        "    batch_size = 64,\n"
        "    shuffle=True,  # shuffled\n"
        "    num_workers = 4,\n"  # the call's own `k = v` style
        "    pin_memory = True\n"
        ")\n"
    )


def test_a_hanging_indent_call_gets_the_new_argument_aligned_under_the_others(tmp_path: Path) -> None:
    source = (
        "loader = DataLoader(ds, batch_size=32,\n"
        "                    shuffle=True)\n"
    )
    result, _ = patched(tmp_path, source, (1, {"num_workers": 4}))
    assert result == (
        "loader = DataLoader(ds, batch_size=32,\n"
        "                    shuffle=True,\n"
        "                    num_workers=4)\n"
    )


def test_calls_with_one_or_no_argument_and_a_one_line_trailing_comma(tmp_path: Path) -> None:
    source = "a = DataLoader(ds)\nb = DataLoader()\nc = DataLoader(ds, batch_size=2,)\nd = DataLoader(\n    ds\n)\n"
    wanted: dict[str, Value] = {"num_workers": 4, "pin_memory": True}
    result, patch = patched(tmp_path, source, *[(line, wanted) for line in (1, 2, 3, 4)])
    assert result == (
        "a = DataLoader(ds, num_workers=4, pin_memory=True)\n"
        "b = DataLoader(num_workers=4, pin_memory=True)\n"
        "c = DataLoader(ds, batch_size=2, num_workers=4, pin_memory=True,)\n"
        "d = DataLoader(\n    ds,\n    num_workers=4,\n    pin_memory=True\n)\n"
    )
    assert [line.split(" ")[0] for line in patch.changed] == ["train.py:1", "train.py:2", "train.py:3", "train.py:4"]


@pytest.mark.parametrize("expression", ["args.workers", "workers", "os.cpu_count()", "n + 1", 'f"{n}"', "cfg['w']"])
def test_a_keyword_the_script_computes_is_its_own_setting_and_the_whole_call_is_skipped(
    tmp_path: Path, expression: str
) -> None:
    source = f"loader = DataLoader(ds, num_workers={expression})\n"
    result, patch = patched(tmp_path, source, (1, {"num_workers": 4, "persistent_workers": True}))
    assert result == source and patch.diff == "" and patch.changed == []  # not persistent_workers alone either
    assert patch.skipped == [
        f"train.py:1: num_workers={expression} is the script's own setting: give it 4 where {expression} comes from "
        "(a flag or config) (fix num_workers not made)"
    ]


def test_all_or_nothing_per_call_covers_every_fix_on_it(tmp_path: Path) -> None:
    source = "loader = DataLoader(ds, num_workers=args.workers)\nother = DataLoader(ds)\n"
    path = write(tmp_path, "train.py", source)
    patch = keyword_patch([edit(path, 1, num_workers=4), edit(path, 1, "pin_memory", pin_memory=True),
                           edit(path, 2, "pin_memory", pin_memory=True)], root=tmp_path)
    assert applied(source, patch.diff) == "loader = DataLoader(ds, num_workers=args.workers)\n" \
                                          "other = DataLoader(ds, pin_memory=True)\n"
    assert [s.split(" (fix ")[1] for s in patch.skipped] == ["num_workers not made)", "pin_memory not made)"]
    assert all("num_workers=args.workers is the script's own setting" in s for s in patch.skipped)


def test_a_call_with_double_star_kwargs_skips_a_keyword_it_would_add_but_replaces_one_it_has(tmp_path: Path) -> None:
    source = "a = DataLoader(ds, **opts)\nb = DataLoader(ds, num_workers=0, **opts)\n"
    result, patch = patched(tmp_path, source, (1, {"num_workers": 4}), (2, {"num_workers": 4}))
    assert result == "a = DataLoader(ds, **opts)\nb = DataLoader(ds, num_workers=4, **opts)\n"
    assert patch.skipped == ["train.py:1: the call passes **opts, which may already set num_workers: "
                             "set num_workers=4 there or in the call by hand (fix num_workers not made)"]


def test_a_keyword_passed_by_position_or_through_star_args_is_not_added_twice(tmp_path: Path) -> None:
    source = (
        "a = DataLoader(ds, 32, True, None, None, 2)\n"  # num_workers is the sixth
        "b = DataLoader(ds, 32)\n"
        "c = DataLoader(*parts)\n"
        "d = DataLoader(ds, 32, True, None, None, 2)\n"
    )
    result, patch = patched(tmp_path, source, (1, {"num_workers": 4}), (2, {"num_workers": 4}), (3, {"num_workers": 4}),
                            (4, {"persistent_workers": True}))  # keyword-only in DataLoader: safe to add
    assert result == (
        "a = DataLoader(ds, 32, True, None, None, 2)\n"
        "b = DataLoader(ds, 32, num_workers=4)\n"
        "c = DataLoader(*parts)\n"
        "d = DataLoader(ds, 32, True, None, None, 2, persistent_workers=True)\n"
    )
    assert [s.split(": ", 1)[0] for s in patch.skipped] == ["train.py:1", "train.py:3"]
    assert "num_workers is passed by position (argument 6)" in patch.skipped[0]
    assert "*parts" in patch.skipped[1]


def test_a_keyword_already_at_its_value_changes_nothing_and_is_reported_nowhere(tmp_path: Path) -> None:
    source = "a = DataLoader(ds, num_workers=4, timeout=30.0)\nb = DataLoader(ds, num_workers=4)\n"
    result, patch = patched(tmp_path, source, (1, {"num_workers": 4, "timeout": 30}),
                            (2, {"num_workers": 4, "pin_memory": True}))
    assert result == source.replace("(ds, num_workers=4)", "(ds, num_workers=4, pin_memory=True)")  # b only
    assert patch.changed == ["train.py:2 DataLoader(...): pin_memory=True (added) [fix num_workers]"]
    assert patch.skipped == []
    nothing = keyword_patch([edit(tmp_path / "train.py", 1, num_workers=4)], root=tmp_path)
    assert nothing == KeywordPatch(diff="", changed=[], skipped=[])


@pytest.mark.parametrize(
    "source",
    [
        "import torch\n\nloader = DataLoader(ds)\n",  # the call moved since the report
        "# DataLoader(ds, num_workers=0)\n",  # a comment is not a call
        'x = "DataLoader(ds)"\n',  # nor a string
        "loader = make_loader(ds, num_workers=0)\n",  # another callee
    ],
)
def test_no_matching_call_at_the_line_is_skipped_with_the_reason(tmp_path: Path, source: str) -> None:
    _, patch = patched(tmp_path, source, (1, {"num_workers": 4}))
    assert patch.diff == "" and patch.changed == []
    assert patch.skipped == ["train.py:1: no DataLoader(...) call at this line (the file may have changed since the "
                             "report): set num_workers=4 in the call by hand (fix num_workers not made)"]


def test_the_callee_is_matched_by_its_last_name_and_the_innermost_call_holding_the_line_wins(tmp_path: Path) -> None:
    source = (
        "a = torch.utils.data.DataLoader(ds)\n"
        "b = wrap(\n"
        "    data.DataLoader(ds),\n"
        ")\n"
        "c = DataLoader(DataLoader(ds, num_workers=0), num_workers=1)\n"
        "d = DataLoader(\n"
        "    ds,\n"
        "    batch_size=2,\n"
        ")\n"
        "e, f = DataLoader(x), DataLoader(y)\n"
    )
    # line 3 is inside wrap(...) but only DataLoader counts; line 7 is inside the call of line 6 (a later Python may
    # report it); line 10 holds two calls side by side, so which one ran is not known
    result, patch = patched(tmp_path, source, *[(line, {"num_workers": 4}) for line in (1, 3, 5, 7, 10)])
    assert result == (
        "a = torch.utils.data.DataLoader(ds, num_workers=4)\n"
        "b = wrap(\n"
        "    data.DataLoader(ds, num_workers=4),\n"
        ")\n"
        "c = DataLoader(DataLoader(ds, num_workers=4), num_workers=1)\n"
        "d = DataLoader(\n"
        "    ds,\n"
        "    batch_size=2,\n"
        "    num_workers=4,\n"
        ")\n"
        "e, f = DataLoader(x), DataLoader(y)\n"
    )
    assert [c.split(" ")[0] for c in patch.changed] == ["train.py:1", "train.py:3", "train.py:5", "train.py:6"]
    assert patch.skipped == ["train.py:10: 2 DataLoader(...) calls at this line, so which one ran is not known: "
                             "set num_workers=4 in the call by hand (fix num_workers not made)"]


def test_two_fixes_on_one_call_merge_and_a_conflicting_second_is_skipped(tmp_path: Path) -> None:
    source = "loader = DataLoader(ds, num_workers=0)\n"
    path = write(tmp_path, "train.py", source)
    patch = keyword_patch([
        edit(path, 1, "num_workers", num_workers=4, persistent_workers=True),
        edit(path, 1, "pin_memory", pin_memory=True),
        edit(path, 1, "more_workers", num_workers=8, prefetch_factor=4),
        edit(path, 1, "same_workers", num_workers=4),  # agrees with the first: merged
    ], root=tmp_path)
    assert applied(source, patch.diff) == \
        "loader = DataLoader(ds, num_workers=4, persistent_workers=True, pin_memory=True)\n"
    assert patch.diff.count("diff --git") == 1
    assert patch.changed == ["train.py:1 DataLoader(...): num_workers=0 -> 4, persistent_workers=True (added), "
                             "pin_memory=True (added) [fixes num_workers, pin_memory, same_workers]"]
    assert patch.skipped == ["train.py:1: fix more_workers sets num_workers=8 but fix num_workers sets num_workers=4 "
                             "in the same call, and the first is kept: choose by hand (fix more_workers not made)"]


def test_several_files_give_one_section_each_in_path_order(tmp_path: Path) -> None:
    b = write(tmp_path, "b.py", "x = DataLoader(ds)\ny = DataLoader(ds)\n")
    a = write(tmp_path, "pkg/a.py", "x = DataLoader(ds)\n")
    patch = keyword_patch([edit(b, 2, num_workers=2), edit(a, 1, num_workers=2), edit(b, 1, num_workers=2)],
                          root=tmp_path)
    headers = [line for line in patch.diff.splitlines() if line.startswith("diff --git")]
    assert headers == ["diff --git a/b.py b/b.py", "diff --git a/pkg/a.py b/pkg/a.py"]
    assert patch.changed[0].startswith("b.py:1 ") and patch.changed[1].startswith("b.py:2 ")
    assert patch.changed[2].startswith("pkg/a.py:1 ")
    assert keyword_patch([edit(b, 2, num_workers=2), edit(a, 1, num_workers=2), edit(b, 1, num_workers=2)],
                         root=tmp_path) == patch  # stable


def test_files_it_cannot_patch_are_skipped_never_raised(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    outside = write(tmp_path, "elsewhere.py", "x = DataLoader(ds)\n")
    broken = write(root, "broken.py", "x = DataLoader(ds\n")
    latin = root / "latin.py"
    latin.write_bytes(b"# -*- coding: latin-1 -*-\nx = DataLoader(ds)  # caf\xe9\n")
    patch = keyword_patch([
        edit(outside, 1, num_workers=2),
        edit(root / "missing.py", 1, num_workers=2),
        edit(broken, 1, num_workers=2),
        edit(latin, 2, num_workers=2),
        edit(root / "broken.py", 1, "nan", timeout=float("nan")),
    ], root=root)
    assert patch == KeywordPatch(diff="", changed=[], skipped=patch.skipped)
    assert len(patch.skipped) == 5
    assert "not under" in patch.skipped[0] and patch.skipped[0].startswith(f"{outside}:1: ")
    assert patch.skipped[1].startswith("missing.py:1: cannot read the file")
    assert patch.skipped[2].startswith("broken.py:1: the file does not parse")
    assert patch.skipped[3].startswith("latin.py:2: the file is not UTF-8")
    assert all(s.endswith("not made)") for s in patch.skipped)


def test_a_file_without_a_final_newline_and_one_with_crlf_line_endings(tmp_path: Path) -> None:
    no_newline = "import torch\nloader = DataLoader(ds, num_workers=0)"
    result, patch = patched(tmp_path, no_newline, (2, {"num_workers": 4}))
    assert result == "import torch\nloader = DataLoader(ds, num_workers=4)"
    assert patch.diff.endswith("-loader = DataLoader(ds, num_workers=0)\n\\ No newline at end of file\n"
                               "+loader = DataLoader(ds, num_workers=4)\n\\ No newline at end of file\n")
    crlf = "import torch\r\nloader = DataLoader(\r\n    ds,\r\n)\r\n"
    result, _ = patched(tmp_path, crlf, (2, {"num_workers": 4}))
    assert result == "import torch\r\nloader = DataLoader(\r\n    ds,\r\n    num_workers=4,\r\n)\r\n"


GIT = shutil.which("git")


def _git(cwd: Path, *args: str) -> None:
    subprocess.run([GIT or "git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false",
                    "-c", "core.autocrlf=false", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


@pytest.mark.skipif(GIT is None, reason="git is not installed")
def test_git_apply_takes_the_patch_and_gives_the_expected_sources(tmp_path: Path) -> None:
    scripts = {
        "train.py": (
            "import torch\n"
            "from torch.utils import data\n"
            "\n"
            "\n"
            "def main(args):\n"
            "    # DataLoader(ds, num_workers=0): a comment, left alone\n"
            "    train = data.DataLoader(\n"
            "        ds,\n"
            "        batch_size=args.batch_size,  # from the flags\n"
            "        num_workers=0,\n"
            "    )\n"
            "    val = torch.utils.data.DataLoader(ds, batch_size=8)  # validation\n"
            "    return train, val\n"
        ),
        "my scripts/tür.py": "loader = DataLoader(ds, pin_memory=False)",  # a space, non-ASCII, no final newline
        "crlf.py": "loader = DataLoader(ds)\r\n",
    }
    repo = tmp_path / "repo"
    paths = {name: write(repo, name, source) for name, source in scripts.items()}
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "scripts")
    patch = keyword_patch([
        edit(paths["train.py"], 7, num_workers=4, persistent_workers=True),
        edit(paths["train.py"], 12, "pin_memory", pin_memory=True),
        edit(paths["my scripts/tür.py"], 1, "pin_memory", pin_memory=True),
        edit(paths["crlf.py"], 1, num_workers=2),
    ], root=repo)
    assert patch.skipped == [] and len(patch.changed) == 4
    (tmp_path / "fix.diff").write_bytes(patch.diff.encode("utf-8"))
    _git(repo, "apply", "--check", str(tmp_path / "fix.diff"))
    _git(repo, "apply", str(tmp_path / "fix.diff"))
    expected = {
        "train.py": (
            "import torch\n"
            "from torch.utils import data\n"
            "\n"
            "\n"
            "def main(args):\n"
            "    # DataLoader(ds, num_workers=0): a comment, left alone\n"
            "    train = data.DataLoader(\n"
            "        ds,\n"
            "        batch_size=args.batch_size,  # from the flags\n"
            "        num_workers=4,\n"
            "        persistent_workers=True,\n"
            "    )\n"
            "    val = torch.utils.data.DataLoader(ds, batch_size=8, pin_memory=True)  # validation\n"
            "    return train, val\n"
        ),
        "my scripts/tür.py": "loader = DataLoader(ds, pin_memory=True)",
        "crlf.py": "loader = DataLoader(ds, num_workers=2)\r\n",
    }
    assert {name: paths[name].read_bytes().decode("utf-8") for name in scripts} == expected

    patch_tool = shutil.which("patch")
    if patch_tool is not None:  # `patch -p1` takes it too, from a clean tree
        _git(repo, "checkout", "--", ".")
        subprocess.run([patch_tool, "-p1", "--quiet", "-i", str(tmp_path / "fix.diff")], cwd=repo, check=True,
                       capture_output=True, timeout=30)
        assert {name: paths[name].read_bytes().decode("utf-8") for name in scripts} == expected
