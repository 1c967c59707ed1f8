"""Where the script made what a fix changes (capture/sites.py) and the framework setting a fix names in its place
(fixes/where.py): code in a folder named like an installed framework's calls back into this file, as the HF Trainer
builds a DataLoader for the user's script, or Lightning calls the user's hook."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from trainfast.diagnose.capture.instrument import Instrumentation
from trainfast.diagnose.capture.sites import site_of
from trainfast.diagnose.capture.timeline import Timeline
from trainfast.diagnose.fixes.where import setting


def _package(tmp_path: Path, package: str, code: str) -> ModuleType:
    """A module at site-packages/PACKAGE/loop.py under tmp_path, imported."""
    path = tmp_path / "site-packages" / package / "loop.py"
    path.parent.mkdir(parents=True)
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(f"_fake_{package}_loop", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _made_here() -> Any:
    return site_of("loader")


def test_an_object_made_inside_a_framework_names_the_framework_and_the_scripts_line_that_called_it(
        tmp_path: Path) -> None:
    transformers = _package(tmp_path, "transformers", "def train(make):\n    return make()\n")
    line = sys._getframe().f_lineno + 1
    site = transformers.train(functools.partial(site_of, "loader"))  # (as a hook in DataLoader.__init__ is called)
    assert site.framework == "transformers" and site.file == __file__ and site.line == line
    assert site.code.startswith("site = transformers.train(")


def test_the_scripts_own_code_called_by_a_framework_names_that_framework(tmp_path: Path) -> None:
    lightning = _package(tmp_path, "lightning", "def fit(hook):\n    return hook()\n")
    site = lightning.fit(_made_here)
    assert site.framework == "lightning" and site.file == __file__ and site.code == 'return site_of("loader")'


def test_an_installed_package_that_is_no_framework_is_only_skipped(tmp_path: Path) -> None:
    other = _package(tmp_path, "tqdm", "def wrap(make):\n    return make()\n")
    site = other.wrap(functools.partial(site_of, "loader"))
    assert site.framework is None and site.file == __file__


def test_a_framework_setting_takes_the_fixs_value_and_one_it_lacks_says_where_to_look() -> None:
    assert setting("transformers", "num_workers", {"num_workers": 4, "persistent_workers": True}) == (
        "TrainingArguments(dataloader_num_workers=4, dataloader_persistent_workers=True)")
    assert setting("lightning", "amp", {"autocast": "bfloat16"}) == "Trainer(precision='bf16-mixed')"
    assert setting("timm", "prefetch_factor", {"prefetch_factor": 4}).startswith("made inside timm: set it where")


class _HashedAfterInit(torch.nn.Module):
    """torchmetrics' `Metric` in this respect: its `__hash__` reads state its `__init__` sets after
    `nn.Module.__init__` (every Lightning script that logged a metric crashed under the doctor)."""

    def __init__(self) -> None:
        super().__init__()
        self._defaults = {"total": 0}
        self.net = torch.nn.Linear(4, 1)

    def __hash__(self) -> int:
        return hash(tuple(self._defaults))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_a_module_whose_hash_needs_its_own_init_is_made_and_moved_under_the_hooks() -> None:
    inst = Instrumentation(Timeline(warmup_steps=0))
    with inst:
        model = _HashedAfterInit()  # the model's line: where it was made
        model.to("cpu")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.randn(8, 4)).sum().backward()
            optimizer.step()
    made, moved = inst.observed.sites["model"], inst.observed.sites["to"]
    assert made.file.endswith("test_sites.py") and "_HashedAfterInit()" in made.code
    assert "model.to(" in moved.code
