"""The Python API tour's examples (docs/python-api.md, the README's link for the library) run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

TOUR = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"


@pytest.mark.slow
def test_the_python_api_tour_runs(demo_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    blocks = re.findall(r"```python\n(.*?)```", TOUR.read_text(), flags=re.S)
    assert blocks, "docs/python-api.md has no python example"
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "readme"}  # the blocks build on each other, as a reader would run them
    for code in blocks:
        exec(compile(code, str(TOUR), "exec"), namespace)
    assert (tmp_path / "runs" / "demo" / "last.pt").exists()
    assert namespace["result"].val_accuracy > 0.2  # 10 classes  # type: ignore[attr-defined]
    assert namespace["report"].verdict is not None  # type: ignore[attr-defined]
    assert namespace["doctor"].report.verdict is not None  # type: ignore[attr-defined]

