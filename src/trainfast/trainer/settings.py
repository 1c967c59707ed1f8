"""Global torch settings the Trainer may change, only when asked, and always puts back.

TF32 has two APIs sharing one state. The legacy one: `torch.set_float32_matmul_precision` (and
`torch.backends.cuda.matmul.allow_tf32`) for matmuls, `torch.backends.cudnn.allow_tf32` for cuDNN. The new one
(torch >= 2.9): an `fp32_precision` per level, "ieee" | "tf32" | "none" (bf16 on oneDNN), where "none" inherits
from the level above (`cudnn.conv` from `cudnn`, `cudnn` from `torch.backends`) and a getter returns the inherited
value. Each legacy setter also writes new-API levels; the new setters leave the legacy flags alone, and a legacy
getter raises ("mix of the legacy and new APIs") once the two disagree, e.g. after
`torch.backends.cuda.matmul.fp32_precision = "tf32"` alone. Hence (torch 2.13, measured):

- reading: each new-API level's own value, "none" included (a getter returns the inherited value, so whether a
  level inherits is seen by moving its parent for a moment); a legacy flag through its getter, or where that
  raises, with the levels it compares set for a moment to values it reads with (new setters never change it);
- switching TF32: through a legacy flag where the user's legacy state reads, so that code reading TF32 the legacy
  way inside the block (a callback, torch's autotuner cache keys) still can; through the new-API levels where a
  mix made it unreadable (it then stays so in the block, as the user had it);
- putting back: the legacy flags that now read otherwise, then each new-API level whose own value differs
  (legacy setters write some), parents first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.torch_version import TorchVersion

INHERIT = "none"  # a new-API level with this value takes its parent's
# The new-API levels fp32 precision is read from, parents first, each with its parent. "mkldnn" is only read:
# its public setter writes the generic level instead (torch 2.13), and nothing here changes it.
LEVELS: tuple[tuple[str, str | None], ...] = (
    ("generic", None), ("cuda", "generic"), ("mkldnn", "generic"), ("cuda.matmul", "cuda"), ("cudnn.conv", "cuda"),
    ("cudnn.rnn", "cuda"), ("mkldnn.matmul", "mkldnn"))
PARENT = dict(LEVELS)
READ_ONLY = frozenset({"mkldnn"})
CUDNN_LEVELS = ("cudnn.conv", "cudnn.rnn")  # what `cudnn.allow_tf32` switches
MATMUL_LEGACY_WRITES = ("cuda.matmul", "mkldnn.matmul")  # what `set_float32_matmul_precision` writes
# where each level lives under `torch.backends`
LEVEL_PATHS = {"generic": (), "cuda": ("cudnn",), "mkldnn": ("mkldnn",), "cuda.matmul": ("cuda", "matmul"),
               "cudnn.conv": ("cudnn", "conv"), "cudnn.rnn": ("cudnn", "rnn"), "mkldnn.matmul": ("mkldnn", "matmul")}


def has_new_tf32_api() -> bool:
    """torch >= 2.9's per-level `fp32_precision` ("ieee" / "tf32" / "none"; earlier versions spelt it otherwise)."""
    return TorchVersion(torch.__version__) >= "2.9.0a0" and hasattr(torch.backends, "fp32_precision")


def _level(name: str) -> Any:
    return functools.reduce(getattr, LEVEL_PATHS[name], torch.backends)


def _read(name: str) -> str:
    return str(_level(name).fp32_precision)


def _write(name: str, value: str) -> None:
    _level(name).fp32_precision = value


def _legacy_matmul() -> str | None:
    """"highest" / "high" / "medium", or None where the two APIs disagree and the getter raises."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return None


def _legacy_cudnn() -> bool | None:
    try:
        return bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:
        return None


def _as_set(read: dict[str, str]) -> dict[str, str]:
    """Each level's own value, INHERIT where it takes its parent's. A getter returns the inherited value, so a level
    that reads like its parent is told apart by moving the nearest ancestor that can be written for a moment: an
    inheriting level moves with it. One with no such ancestor (under oneDNN's level set through torch's private
    setter) counts as set: it reads the same either way until that level changes."""
    raw: dict[str, str] = {}
    for name, parent in LEVELS:
        value = read[name]
        if parent is None or value == INHERIT or value != read[parent]:
            raw[name] = value
            continue
        mover: str | None = parent
        if parent in READ_ONLY:
            mover = PARENT[parent] if raw[parent] == INHERIT else None
        if mover is None:
            raw[name] = value
            continue
        other = "ieee" if value == "tf32" else "tf32"
        _write(mover, other)
        try:
            raw[name] = INHERIT if _read(name) == other else value
        finally:
            _write(mover, raw[mover])
    return raw


T = TypeVar("T")


def _probe(levels: tuple[str, ...], values: tuple[str, ...], getter: Callable[[], T | None],
           raw: dict[str, str]) -> T | None:
    """A legacy flag whose getter raises on a mix: read with `levels` briefly at each of `values` in turn (the new
    setters leave the legacy flag as it is), then the levels put back to `raw`. None if no value lets it read."""
    try:
        for value in values:
            for name in levels:
                _write(name, value)
            got = getter()
            if got is not None:
                return got
        return None
    finally:
        for name in levels:
            _write(name, raw[name])


@dataclass(frozen=True)
class TF32State:
    """What the user had: the legacy flags (None: not readable even by probing) and each new-API level's own value
    (INHERIT where it takes its parent's; empty before torch 2.9)."""

    matmul: str | None
    cudnn: bool | None
    raw: dict[str, str]

    @classmethod
    def capture(cls) -> TF32State:
        read = {name: _read(name) for name, _ in LEVELS} if has_new_tf32_api() else {}
        raw = _as_set(read) if read else {}
        matmul, cudnn = _legacy_matmul(), _legacy_cudnn()
        if read and matmul is None:  # every legacy matmul precision reads with the CUDA and oneDNN matmuls at ieee
            matmul = _probe(MATMUL_LEGACY_WRITES, ("ieee",), _legacy_matmul, raw)
        if read and cudnn is None:  # cuDNN's legacy flag reads where conv and rnn agree with it
            cudnn = _probe(CUDNN_LEVELS, ("tf32", "ieee"), _legacy_cudnn, raw)
        return cls(matmul, cudnn, raw)

    def restore(self) -> None:
        """Put back what `capture` saw: each legacy flag that now reads otherwise, or not at all (a mix: its value is
        unknown until set), then each new-API level whose own value differs, parents first. Own values, not what
        the getters return: a level the block set to "none" under a parent of the same value reads the same."""
        if self.matmul is not None and _legacy_matmul() != self.matmul:
            torch.set_float32_matmul_precision(self.matmul)
        if self.cudnn is not None and _legacy_cudnn() != self.cudnn:
            torch.backends.cudnn.allow_tf32 = self.cudnn
        if self.raw:
            now = _as_set({name: _read(name) for name, _ in LEVELS})
            for name, _ in LEVELS:
                if name not in READ_ONLY and now[name] != self.raw[name]:
                    _write(name, self.raw[name])


def set_tf32(enabled: bool) -> None:
    """TF32 on or off for CUDA matmuls and cuDNN (convolutions and RNNs); nothing else. Not put back: call it inside
    `torch_settings()`, which restores what the user had."""
    matmul, cudnn = _legacy_matmul(), _legacy_cudnn()
    target = "tf32" if enabled else "ieee"
    if not has_new_tf32_api():
        if matmul is not None and (matmul != "highest") != enabled:
            torch.backends.cuda.matmul.allow_tf32 = enabled
        if cudnn is not None and cudnn != enabled:
            torch.backends.cudnn.allow_tf32 = enabled
        return
    # "highest" and "high" mean exactly TF32 off and on for CUDA matmuls; `cuda.matmul.allow_tf32` moves between
    # them and writes only the CUDA matmul level ("medium" also means bf16 for oneDNN: left alone).
    if matmul == ("highest" if enabled else "high"):
        torch.backends.cuda.matmul.allow_tf32 = enabled
    if cudnn is not None and cudnn != enabled:
        torch.backends.cudnn.allow_tf32 = enabled
    for name in ("cuda.matmul", *CUDNN_LEVELS):  # where a mix left the legacy flags unreadable
        if (_read(name) == "tf32") != enabled:
            _write(name, target)


@contextmanager
def torch_settings(*, cpu_threads: int | None = None, cudnn_benchmark: bool | None = None,
                   tf32: bool = False) -> Iterator[None]:
    """Intra-op threads, `cudnn.benchmark` and TF32 for a block (None / False leave a setting alone). All three are
    put back on exit, also when code in the block changed them (the doctor runs a user's script inside)."""
    saved = torch.get_num_threads(), torch.backends.cudnn.benchmark, TF32State.capture()
    try:
        if cpu_threads is not None:
            torch.set_num_threads(cpu_threads)
        if cudnn_benchmark is not None:
            torch.backends.cudnn.benchmark = cudnn_benchmark
        if tf32:
            set_tf32(True)
        yield
    finally:
        threads, benchmark, tf32_state = saved
        torch.set_num_threads(threads)
        torch.backends.cudnn.benchmark = benchmark
        tf32_state.restore()
