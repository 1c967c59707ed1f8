"""The Python API tour's examples (docs/python-api.md, the README's link for the library) run as written.

`make test` runs them on a smaller demo dataset (48 training and 8 validation images per class instead of the quick
dataset's 160 and 40: 7 batches an epoch instead of 25); `make stress` on the quick dataset itself, where the trained
model must also have learned, which the smaller one does not promise in its 3 epochs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import trainfast
from trainfast.data.synthetic import DemoSize

TOUR = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"
SMALL = DemoSize(name="tour-small", train_per_class=48, val_per_class=8)


@pytest.mark.slow
@pytest.mark.parametrize("size", ["small", pytest.param("quick", marks=pytest.mark.stress)])
def test_the_python_api_tour_runs(size: str, demo_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    blocks = re.findall(r"```python\n(.*?)```", TOUR.read_text(), flags=re.S)
    assert blocks, "docs/python-api.md has no python example"
    assert 'trainfast.ensure_demo_dataset("quick")' in blocks[0]  # the dataset the small run makes smaller
    if size == "small":
        real = trainfast.ensure_demo_dataset

        def smaller(name: Any = "quick", **kwargs: Any) -> Path:
            return real(SMALL if name == "quick" else name, **kwargs)
        monkeypatch.setattr(trainfast, "ensure_demo_dataset", smaller)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "readme"}  # the blocks build on each other, as a reader would run them
    for code in blocks:
        exec(compile(code, str(TOUR), "exec"), namespace)
    assert (tmp_path / "runs" / "demo" / "last.pt").exists()
    result = namespace["result"]
    assert result.steps == 3 * (SMALL.train_per_class * 10 // 64 if size == "small" else 25)  # type: ignore[attr-defined]
    if size == "quick":
        assert result.val_accuracy > 0.2  # 10 classes  # type: ignore[attr-defined]
    else:
        assert 0 <= result.val_accuracy <= 1  # type: ignore[attr-defined]
    assert namespace["report"].verdict is not None  # type: ignore[attr-defined]
    assert namespace["doctor"].report.verdict is not None  # type: ignore[attr-defined]
