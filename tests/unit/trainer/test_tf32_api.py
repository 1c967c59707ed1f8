"""TF32 under torch's two APIs: torch_settings and set_tf32 never raise on a mix of them, switch TF32 for the block,
and put back exactly what the user had, down to which levels inherit.

The legacy API (`torch.set_float32_matmul_precision`, `torch.backends.cuda.matmul.allow_tf32`,
`torch.backends.cudnn.allow_tf32`) and the new one (torch >= 2.9, `fp32_precision` per level) share state: a
legacy getter raises once the two disagree, e.g. after `torch.backends.cuda.matmul.fp32_precision = "tf32"`.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from trainfast.trainer import settings
from trainfast.trainer.settings import torch_settings

B = torch.backends
pytestmark = pytest.mark.skipif(not hasattr(B, "fp32_precision"),
                                reason=f"torch {torch.__version__} has no fp32_precision API (torch < 2.9)")

# every level the new API has on this torch, parents before children, as attribute paths under torch.backends
PATHS = {"generic": (), "cuda": ("cudnn",), "cuda.matmul": ("cuda", "matmul"), "cudnn.conv": ("cudnn", "conv"),
         "cudnn.rnn": ("cudnn", "rnn"), "mkldnn": ("mkldnn",), "mkldnn.matmul": ("mkldnn", "matmul"),
         "mkldnn.conv": ("mkldnn", "conv"), "mkldnn.rnn": ("mkldnn", "rnn")}


def level(name: str) -> Any:
    return functools.reduce(getattr, PATHS[name], B)


def put(name: str, value: str) -> None:
    level(name).fp32_precision = value


RAISES = "raises"


def _legacy(read: Callable[[], object]) -> object:
    try:
        return read()
    except RuntimeError:  # "... mix of the legacy and new APIs ..."
        return RAISES


def observed() -> dict[str, object]:
    """Everything a user can read about fp32 precision, a legacy getter that raises included."""
    seen = {name: level(name).fp32_precision for name in PATHS}
    return seen | {"legacy matmul": _legacy(torch.get_float32_matmul_precision),
                   "legacy cuda.matmul": _legacy(lambda: B.cuda.matmul.allow_tf32),
                   "legacy cudnn": _legacy(lambda: B.cudnn.allow_tf32)}


@pytest.fixture
def tf32_back() -> Iterator[None]:
    """Torch's default fp32 state before the test and after it, whatever the test set (conftest reads the legacy
    matmul precision around every test, which must not raise)."""
    _defaults()
    yield
    _defaults()


def _defaults() -> None:
    torch.set_float32_matmul_precision("highest")  # the legacy flags first: their setters write new-API levels
    B.cudnn.allow_tf32 = True
    for name in ("generic", "cuda", "cuda.matmul", "mkldnn.matmul"):
        put(name, "none")
    put("cudnn.conv", "tf32")
    put("cudnn.rnn", "tf32")


def _new_matmul_tf32() -> None:
    put("cuda.matmul", "tf32")


def _new_all_ieee() -> None:
    put("generic", "ieee")


def _new_mixed_cudnn() -> None:
    put("cuda.matmul", "tf32")
    put("cudnn.conv", "ieee")


def _legacy_off() -> None:
    torch.set_float32_matmul_precision("highest")
    B.cudnn.allow_tf32 = False


def _legacy_medium() -> None:
    torch.set_float32_matmul_precision("medium")


STARTS = {"torch defaults": lambda: None, "new API: cuda matmul tf32": _new_matmul_tf32,
          "new API: everything ieee": _new_all_ieee, "new API: matmul tf32, cudnn conv ieee": _new_mixed_cudnn,
          "legacy: TF32 off": _legacy_off, "legacy: medium": _legacy_medium}


@pytest.mark.parametrize("start", STARTS.values(), ids=STARTS.keys())
def test_tf32_block_never_raises_and_puts_back_exactly(tf32_back: None, start: Callable[[], None]) -> None:
    start()
    before = observed()
    with torch_settings(tf32=True):
        inside = observed()
        assert (inside["cuda.matmul"], inside["cudnn.conv"], inside["cudnn.rnn"]) == ("tf32", "tf32", "tf32")
    assert observed() == before
    with torch_settings():
        assert observed() == before
    assert observed() == before


@pytest.mark.parametrize("start", [_legacy_off, lambda: None], ids=["legacy: TF32 off", "torch defaults"])
def test_legacy_getters_still_read_inside_when_they_did_before(tf32_back: None, start: Callable[[], None]) -> None:
    """Code inside the block that reads TF32 the legacy way (a callback; torch's autotuner keys its cache on
    get_float32_matmul_precision) must not start raising because trainfast switched TF32 on."""
    start()
    with torch_settings(tf32=True):
        assert torch.get_float32_matmul_precision() == "high"
        assert B.cuda.matmul.allow_tf32 is True and B.cudnn.allow_tf32 is True
    with torch_settings():
        settings.set_tf32(False)
        assert torch.get_float32_matmul_precision() == "highest" and B.cudnn.allow_tf32 is False
        assert (level("cuda.matmul").fp32_precision, level("cudnn.conv").fp32_precision) != ("tf32", "tf32")


def test_inheriting_levels_still_inherit_after_the_block(tf32_back: None) -> None:
    """A level the user left to inherit (value "none") is put back as "none", not as the value it read: a later
    change of its parent still reaches it."""
    put("generic", "ieee")
    with torch_settings(tf32=True):
        pass
    put("generic", "tf32")
    assert level("cuda.matmul").fp32_precision == "tf32"  # follows the generic level, as before the block


@pytest.mark.parametrize("start", STARTS.values(), ids=STARTS.keys())
def test_a_script_changing_both_apis_is_put_back(tf32_back: None, start: Callable[[], None]) -> None:
    """The doctor runs a script inside torch_settings(): whatever it sets, through either API, is undone, the
    legacy flags included where a mix made them unreadable at the start."""
    start()
    before = observed()
    with torch_settings():
        torch.set_float32_matmul_precision("medium")
        B.cudnn.allow_tf32 = False
        put("generic", "tf32")
        put("cudnn.rnn", "ieee")
    assert observed() == before


def test_put_back_after_an_exception(tf32_back: None) -> None:
    _new_mixed_cudnn()
    before = observed()
    with pytest.raises(RuntimeError, match="boom"), torch_settings(tf32=True):
        raise RuntimeError("boom")
    assert observed() == before


@pytest.mark.parametrize("enabled", [True, False])
def test_set_tf32_on_a_mix(tf32_back: None, enabled: bool) -> None:
    """The doctor's --verify switches TF32 either way, also when the script's user had mixed the APIs."""
    _new_mixed_cudnn()
    before = observed()
    with torch_settings():
        settings.set_tf32(enabled)
        want = "tf32" if enabled else "ieee"
        assert [level(n).fp32_precision for n in ("cuda.matmul", "cudnn.conv", "cudnn.rnn")] == [want] * 3
    assert observed() == before


def test_legacy_path_without_the_new_api(tf32_back: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch < 2.9: the legacy flags only, as before."""
    monkeypatch.setattr(settings, "has_new_tf32_api", lambda: False)
    _legacy_off()
    with torch_settings(tf32=True):
        assert torch.get_float32_matmul_precision() == "high" and B.cudnn.allow_tf32 is True
    assert torch.get_float32_matmul_precision() == "highest" and B.cudnn.allow_tf32 is False


CUDA_VALUES = ("ieee", "tf32", "none")
WRITABLE = {"generic": CUDA_VALUES, "cuda": CUDA_VALUES, "cuda.matmul": CUDA_VALUES, "cudnn.conv": CUDA_VALUES,
            "cudnn.rnn": CUDA_VALUES, "mkldnn.matmul": ("ieee", "bf16", "tf32", "none")}


def random_change(r: random.Random) -> None:
    """One setting changed through either API, as user code might."""
    kind = r.randrange(5)
    if kind == 0:
        torch.set_float32_matmul_precision(r.choice(["highest", "high", "medium"]))
    elif kind == 1:
        B.cudnn.allow_tf32 = r.random() < 0.5
    elif kind == 2:
        B.cuda.matmul.allow_tf32 = r.random() < 0.5
    else:
        name = r.choice(list(WRITABLE))
        put(name, r.choice(WRITABLE[name]))


def what_follows() -> list[dict[str, object]]:
    """What each level reads after its parents move: shows which levels inherit (a getter alone cannot)."""
    seen = []
    for name, value in [("generic", "tf32"), ("generic", "ieee"), ("cuda", "tf32"), ("cuda", "ieee")]:
        put(name, value)
        seen.append(observed())
    return seen


@pytest.mark.parametrize("seed", range(0, 1000, 100))
def test_any_mix_of_both_apis_is_put_back_exactly(tf32_back: None, seed: int) -> None:
    """Random user settings through both APIs, a block that switches TF32 or changes more; afterwards every getter
    reads as before, and every level inherits as before (compared with the same settings replayed without it)."""
    for case in range(seed, seed + 100):
        r = random.Random(case)
        changes = r.randrange(6)
        _defaults()
        replay = random.Random(case)
        for _ in range(changes):
            random_change(replay)
        before = observed()
        with torch_settings(tf32=r.random() < 0.5):
            for _ in range(r.randrange(3)):
                random_change(r)
            if r.random() < 0.3:
                settings.set_tf32(r.random() < 0.5)
        assert observed() == before, f"case {case}"
        after_block = what_follows()
        _defaults()
        replay = random.Random(case)
        for _ in range(changes):
            random_change(replay)
        assert what_follows() == after_block, f"case {case}"
