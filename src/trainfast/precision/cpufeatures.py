"""Does this CPU multiply in bf16 natively (AMX-BF16, AVX512-BF16, ARM BF16)? Asked of torch, then of the OS.

Where it does, bf16 autocast trains conv nets and transformers 1.3-1.7x faster than fp32 (the demo ConvNet on a
2-core AVX512-BF16 EPYC: 1.5x); where it does not, torch emulates bf16, usually slower than fp32.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

# The CPU features that give a native bf16 matmul, as `cpu_bf16` names them (best first).
AMX_BF16, AVX512_BF16, ARM_BF16 = "AMX-BF16", "AVX512-BF16", "ARM BF16"
CPU_BF16_FEATURES = "AMX/AVX512-BF16/ARM BF16"
_CPU_FLAGS = (("amx_bf16", AMX_BF16), ("avx512_bf16", AVX512_BF16), ("bf16", ARM_BF16))
_CPUINFO = Path("/proc/cpuinfo")
# oneDNN's x86 ISAs that use AVX512-BF16, and those that use AMX: an ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) below
# them makes oneDNN, which runs torch's bf16 matmuls and convolutions on the CPU, emulate bf16 (a small conv step 24-32x
# slower here with AVX2 than with AVX512-BF16) whatever the CPU has
_ONEDNN_AMX = ("AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "ALL", "DEFAULT")
_ONEDNN_BF16 = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", *_ONEDNN_AMX)
_SYSCTL_TIMEOUT_S = 2.0


def parse_cpu_flags(cpuinfo_text: str) -> str | None:
    """The native-bf16 feature named in /proc/cpuinfo text (x86 `flags`, aarch64 `Features` lines), or None.

    `amx_bf16` -> "AMX-BF16", `avx512_bf16` -> "AVX512-BF16", `bf16` -> "ARM BF16"; whole words only (aarch64's
    `svebf16`/`ebf16` alone do not count). Pure: no I/O.
    """
    words: set[str] = set()
    for line in cpuinfo_text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            words.update(value.split())
    return next((name for flag, name in _CPU_FLAGS if flag in words), None)


def _torch_cpu_bf16() -> str | None:
    """From torch's own CPU probes (`torch.cpu.get_capabilities`, else the older private `_is_*_supported`)."""
    cpu = getattr(torch, "cpu", None)
    get_capabilities: Callable[[], object] | None = getattr(cpu, "get_capabilities", None)
    if get_capabilities is not None:
        try:
            found = get_capabilities()
        except Exception:  # a private/new API: any failure just means "no answer here"
            found = None
        if isinstance(found, Mapping):
            return next((name for flag, name in _CPU_FLAGS if found.get(flag) is True), None)
    for probe_name, name in (("_is_amx_tile_supported", AMX_BF16), ("_is_avx512_bf16_supported", AVX512_BF16)):
        probe: Callable[[], object] | None = getattr(cpu, probe_name, None)
        if probe is None:
            continue
        try:
            if probe() is True:
                return name
        except Exception:  # a failing private probe is a missing source, not an error
            continue
    return None


def _linux_cpu_bf16() -> str | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        text = _CPUINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return parse_cpu_flags(text)


def _darwin_cpu_bf16() -> str | None:
    if platform.system() != "Darwin":
        return None
    try:
        out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True,
                             timeout=_SYSCTL_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return ARM_BF16 if out.returncode == 0 and out.stdout.strip() == "1" else None


_CPU_BF16_SOURCES: tuple[Callable[[], str | None], ...] = (_torch_cpu_bf16, _linux_cpu_bf16, _darwin_cpu_bf16)


@functools.cache
def cpu_bf16() -> str | None:
    """The native-bf16 CPU feature of this host ("AMX-BF16", "AVX512-BF16", "ARM BF16"), or None.

    Asks, in order, torch's CPU probes, /proc/cpuinfo (Linux) and `sysctl hw.optional.arm.FEAT_BF16` (macOS); the
    first source that names a feature wins, and a source that is missing or fails counts as silent; then what
    ONEDNN_MAX_CPU_ISA lets oneDNN use of it (`onednn_capped`). Cached: the host does not change
    (`cpu_bf16.cache_clear()` in tests).
    """
    for source in _CPU_BF16_SOURCES:
        try:
            found = source()
        except Exception:  # belt and braces: detection must never break training
            continue
        if found is not None:
            return onednn_capped(found, os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA"))
    return None


def onednn_capped(feature: str, max_isa: str | None) -> str | None:
    """`feature` as oneDNN may use it under `max_isa` (ONEDNN_MAX_CPU_ISA): AMX held back leaves AVX512-BF16 (every
    AMX CPU has it), an ISA below AVX512_CORE_BF16 leaves none. ARM's BF16 is not oneDNN's x86 ISA: kept. Pure."""
    if not max_isa or feature == ARM_BF16:
        return feature
    isa = max_isa.strip().upper()
    if feature == AMX_BF16 and isa not in _ONEDNN_AMX:
        feature = AVX512_BF16
    return feature if isa in _ONEDNN_BF16 else None
