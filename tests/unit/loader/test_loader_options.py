"""`LoaderOptions` -> `resolve_loader` -> `build_loader`: the options are make_loader's keywords (names, defaults,
validation), flags generate from them, resolving builds and starts nothing, building gives make_loader's loader."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from trainfast.cli.flags import add_config_flags, config_values
from trainfast.loader import (
    Loader,
    LoaderOptions,
    LoaderResolution,
    TensorLoader,
    build_loader,
    make_loader,
    resolve_loader,
)
from trainfast.loader.prefetch import Normalize


class Squares(Dataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i * i)])


def test_the_fields_are_make_loader_s_keywords_with_its_defaults() -> None:
    keywords = {name: p.default for name, p in inspect.signature(make_loader).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    fields = {f.name: f.default for f in dataclasses.fields(LoaderOptions)}
    assert fields == keywords
    assert all(f.metadata.get("help") for f in dataclasses.fields(LoaderOptions))


def test_options_are_frozen_and_keyword_only() -> None:
    options = LoaderOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(options, "workers", 2)  # noqa: B010
    with pytest.raises(TypeError):
        LoaderOptions(True)  # type: ignore[misc]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"workers": -1}, "workers=-1 is not valid; use 'auto', 'tuned' or an integer >= 0"),
    ({"workers": True}, "workers=True is not valid; use 'auto', 'tuned' or an integer >= 0"),
    ({"prefetch_factor": 0}, "prefetch_factor=0 is not valid; use 'auto' or an integer >= 1"),
    ({"timeout_s": -1}, "timeout_s=-1 is not valid; use a number of seconds >= 0 (0 waits for each batch forever)"),
    ({"timeout_s": float("nan")}, "timeout_s=nan is not valid; use a number of seconds >= 0"),
    ({"device": "tpu"}, "device='tpu' is not valid; use 'auto', 'cpu', 'cuda' or 'cuda:N'"),
])
def test_invalid_options_are_refused_when_made(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        LoaderOptions(**kwargs)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainfast-test")
    add_config_flags(parser, LoaderOptions, skip=("rank", "world_size"))
    return parser


def test_flags_generate_from_the_options_and_parse_into_them() -> None:
    parser = _parser()
    flags = {s for a in parser._actions for s in a.option_strings}
    assert {"--workers", "--pin-memory", "--prefetch-factor", "--persistent-workers", "--drop-last", "--device",
            "--seed", "--multiprocessing-context", "--timeout-s", "--shuffle", "--no-shuffle"} <= flags
    assert not {"--collate-fn", "--normalize", "--rank", "--world-size"} & flags  # objects (flag=False), skipped
    args = parser.parse_args(["--workers", "tuned", "--pin-memory", "false", "--prefetch-factor", "3",
                              "--no-shuffle", "--drop-last", "auto", "--timeout-s", "2.5", "--device", "cuda:1"])
    assert LoaderOptions(**config_values(args, LoaderOptions)) == LoaderOptions(
        workers="tuned", pin_memory=False, prefetch_factor=3, shuffle=False, drop_last="auto", timeout_s=2.5,
        device="cuda:1")
    assert LoaderOptions(**config_values(parser.parse_args(["--workers", "4"]), LoaderOptions)).workers == 4
    assert LoaderOptions(**config_values(parser.parse_args([]), LoaderOptions)) == LoaderOptions()


def test_a_flag_value_of_no_allowed_kind_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--workers", "many"])
    assert "'many' is not valid for --workers; expected int or 'auto' or 'tuned'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=re.escape("workers=-2 is not valid")):  # parsed, refused by the options
        LoaderOptions(**config_values(_parser().parse_args(["--workers", "-2"]), LoaderOptions))


def test_resolving_builds_nothing_and_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr("trainfast.loader.resolve.available_cpus", lambda: 6)
    data = Squares(1000)
    resolution = resolve_loader(data, 8, LoaderOptions(device="cpu"))
    assert isinstance(resolution, LoaderResolution)
    assert (resolution.rank, resolution.world_size, resolution.cpus, resolution.length) == (1, 2, 6, 1000)
    assert resolution.plan.num_workers == 3 and resolution.tensors is None and resolution.samples is data
    assert not any(isinstance(v, torch.utils.data.DataLoader) for v in vars(resolution).values())


def test_build_gives_make_loader_s_loader() -> None:
    options = LoaderOptions(workers=0, device="cpu", seed=3, shuffle=True)
    built = build_loader(resolve_loader(Squares(20), 4, options))
    made = make_loader(Squares(20), 4, workers=0, device="cpu", seed=3, shuffle=True)
    assert isinstance(built, Loader) and isinstance(made, Loader)
    assert built.plan == made.plan
    assert [b.tolist() for b in built] == [b.tolist() for b in made]


@pytest.mark.parametrize("wrap", [TensorDataset, tuple])
def test_tensors_resolve_to_the_in_memory_path_or_a_dataset_for_workers(wrap: Any) -> None:
    x = torch.arange(40.0).reshape(20, 2)
    data = TensorDataset(x) if wrap is TensorDataset else (x,)
    in_place = resolve_loader(data, 4, LoaderOptions(device="cpu", normalize=Normalize()))
    assert in_place.tensors is not None and torch.equal(in_place.tensors[0], x)
    assert in_place.normalize == Normalize()
    assert isinstance(build_loader(in_place), TensorLoader)
    with_workers = resolve_loader(data, 4, LoaderOptions(device="cpu", workers=1))
    assert with_workers.tensors is None and isinstance(with_workers.samples, TensorDataset)
    assert with_workers.plan.in_memory and with_workers.plan.num_workers == 1


def test_default_options_and_an_invalid_batch_size() -> None:
    assert resolve_loader(Squares(8), 4).options == LoaderOptions()
    with pytest.raises(ValueError, match=re.escape("batch_size=0 is not valid; use a positive integer")):
        resolve_loader(Squares(8), 0)
