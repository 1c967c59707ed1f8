"""CPU bf16: detection (torch's probes, /proc/cpuinfo, macOS sysctl) and what "auto" picks per device kind.

Nothing here depends on this machine's CPU: device abilities are faked, and every detection source is replaced.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from trainfast.precision import cpufeatures
from trainfast.precision.cpufeatures import cpu_bf16, onednn_capped, parse_cpu_flags
from trainfast.precision.policy import DeviceCaps, device_caps, resolve_precision

CPU_AMX = DeviceCaps("cpu", bf16=True, bf16_source="AMX-BF16")
CPU_AVX512 = DeviceCaps("cpu", bf16=True, bf16_source="AVX512-BF16")
CPU_ARM = DeviceCaps("cpu", bf16=True, bf16_source="ARM BF16")
CPU_NONE = DeviceCaps("cpu")
VOLTA = DeviceCaps("cuda", (7, 0), bf16=False)
AMPERE = DeviceCaps("cuda", (8, 0), bf16=True, bf16_source="compute capability 8.0")
HOPPER = DeviceCaps("cuda", (9, 0), bf16=True, bf16_source="compute capability 9.0")
MPS = DeviceCaps("mps")

BF16, FP16 = torch.bfloat16, torch.float16
RAISES = "raises"

# requested -> (name, autocast dtype, needs scaler, tf32), or RAISES
BF16_MIXED, FP16_MIXED, FP32 = ("bf16-mixed", BF16, False, False), ("16-mixed", FP16, True, False), \
    ("32-true", None, False, False)
BF16_TF32, FP16_TF32 = ("bf16-mixed", BF16, False, True), ("16-mixed", FP16, True, True)
BF16_CPU = {"auto": BF16_MIXED, "bf16-mixed": BF16_MIXED, "16-mixed": FP16_MIXED, "32-true": FP32}
TABLE: dict[str, tuple[DeviceCaps, dict[str, Any]]] = {
    "cpu-amx": (CPU_AMX, BF16_CPU),
    "cpu-avx512": (CPU_AVX512, BF16_CPU),
    "cpu-arm": (CPU_ARM, BF16_CPU),
    "cpu-none": (CPU_NONE, {"auto": FP32, "bf16-mixed": BF16_MIXED, "16-mixed": FP16_MIXED, "32-true": FP32}),
    "cuda-7.0": (VOLTA, {"auto": FP16_MIXED, "bf16-mixed": RAISES, "16-mixed": FP16_MIXED, "32-true": FP32}),
    "cuda-8.0": (AMPERE, {"auto": BF16_TF32, "bf16-mixed": BF16_TF32, "16-mixed": FP16_TF32, "32-true": FP32}),
    "cuda-9.0": (HOPPER, {"auto": BF16_TF32, "bf16-mixed": BF16_TF32, "16-mixed": FP16_TF32, "32-true": FP32}),
    "mps": (MPS, {"auto": FP32, "bf16-mixed": BF16_MIXED, "16-mixed": FP16_MIXED, "32-true": FP32}),
}
ROWS = [pytest.param(caps, requested, want, id=f"{kind}-{requested}")
        for kind, (caps, wants) in TABLE.items() for requested, want in wants.items()]


@pytest.mark.parametrize(("caps", "requested", "want"), ROWS)
def test_resolution_table(caps: DeviceCaps, requested: str, want: Any) -> None:
    if want == RAISES:
        with pytest.raises(ValueError, match="needs a bf16-capable GPU"):
            resolve_precision(requested, caps)
        return
    p = resolve_precision(requested, caps)
    assert (p.name, p.autocast_dtype, p.needs_scaler, p.tf32) == want
    assert p.device_type == caps.device_type


@pytest.mark.parametrize(("caps", "feature"), [(CPU_AMX, "AMX-BF16"), (CPU_AVX512, "AVX512-BF16"),
                                                (CPU_ARM, "ARM BF16")])
def test_auto_on_a_bf16_cpu_names_the_feature(caps: DeviceCaps, feature: str) -> None:
    assert resolve_precision("auto", caps).reason == (f"CPU has native bf16 ({feature}): bf16 autocast, fp32 weights, "
                                                      "no loss scaling")
    assert resolve_precision("bf16-mixed", caps).reason == "requested"


def test_auto_on_a_bf16_cpu_without_a_named_source() -> None:
    reason = resolve_precision("auto", DeviceCaps("cpu", bf16=True)).reason
    assert reason == "CPU has native bf16: bf16 autocast, fp32 weights, no loss scaling"


def test_cpu_without_bf16_explains_fp32_and_emulation() -> None:
    assert resolve_precision("auto", CPU_NONE).reason == ("CPU has no native bf16 matmul (AMX/AVX512-BF16/ARM BF16): "
                                                          "fp32")
    reason = resolve_precision("bf16-mixed", CPU_NONE).reason
    assert reason.startswith("requested") and "emulates" in reason and "slower" in reason
    assert resolve_precision("32-true", CPU_NONE).reason == "requested"


def test_cuda_reasons_are_unchanged() -> None:
    assert "(8, 0)" in resolve_precision("auto", AMPERE).reason
    assert "GradScaler" in resolve_precision("auto", VOLTA).reason


def test_autocast_on_a_bf16_cpu_computes_in_bf16() -> None:
    a, b = torch.randn(4, 8), torch.randn(8, 2)
    with resolve_precision("auto", CPU_AMX).autocast():
        assert (a @ b).dtype == torch.bfloat16
    with resolve_precision("auto", CPU_NONE).autocast():
        assert (a @ b).dtype == torch.float32


# --- parse_cpu_flags: sample /proc/cpuinfo texts ----------------------------------------------------------------

X86_HEAD = "processor\t: 0\nvendor_id\t: {vendor}\nmodel name\t: {model}\n"
X86_BASE = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht "
            "syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology cpuid pni pclmulqdq ssse3 fma cx16 "
            "pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm abm "
            "3dnowprefetch bmi1 avx2 smep bmi2 erms invpcid")
AVX512 = "avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl avx512_vnni"
ZEN4 = (X86_HEAD.format(vendor="AuthenticAMD", model="AMD EPYC 9654") + f"flags\t\t: {X86_BASE} {AVX512} avx512_bf16 "
        "clzero xsaveerptr avx512vbmi umip pku avx512_vbmi2 gfni vaes vpclmulqdq avx512_bitalg avx512_vpopcntdq\n"
        "bugs\t\t: sysret_ss_attrs spectre_v1 spectre_v2\n")
SAPPHIRE_RAPIDS = (X86_HEAD.format(vendor="GenuineIntel", model="Intel(R) Xeon(R) Platinum 8480+")
                   + f"flags\t\t: {X86_BASE} {AVX512} avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8\n"
                   "vmx flags\t: vnmi preemption_timer\nbugs\t\t: spectre_v1\n")
AVX2_ONLY = X86_HEAD.format(vendor="GenuineIntel", model="Intel(R) Core(TM) i7-8700") + f"flags\t\t: {X86_BASE}\n"
GRAVITON3 = ("processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics "
             "fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat "
             "ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng\nCPU implementer\t: 0x41\n"
             "CPU architecture: 8\nCPU part\t: 0xd40\n")
GRAVITON2 = ("processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics "
             "fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n")


@pytest.mark.parametrize(("text", "feature"), [
    pytest.param(ZEN4, "AVX512-BF16", id="x86-avx512_bf16"),
    pytest.param(SAPPHIRE_RAPIDS, "AMX-BF16", id="x86-amx_bf16-and-avx512_bf16"),
    pytest.param(AVX2_ONLY, None, id="x86-avx2-only"),
    pytest.param(GRAVITON3, "ARM BF16", id="aarch64-bf16"),
    pytest.param(GRAVITON2, None, id="aarch64-without-bf16"),
    pytest.param(GRAVITON2.replace("ssbs", "ssbs svebf16 ebf16"), None, id="aarch64-only-sve-bf16-words"),
    pytest.param(AVX2_ONLY + "model name\t: bf16 avx512_bf16 amx_bf16\n", None, id="flags-only-from-flags-lines"),
    pytest.param("", None, id="empty"),
    pytest.param(ZEN4 * 2 + "\n" + ZEN4, "AVX512-BF16", id="many-processors"),
])
def test_parse_cpu_flags(text: str, feature: str | None) -> None:
    assert parse_cpu_flags(text) == feature


# --- cpu_bf16: the sources in order, each replaceable ------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    cpu_bf16.cache_clear()
    yield
    cpu_bf16.cache_clear()


@pytest.fixture
def no_sources(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Every source silent: torch reports no capability, no /proc/cpuinfo, not macOS. Returns the cpuinfo path."""
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"architecture": "x86_64"})
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(cpufeatures, "_CPUINFO", cpuinfo)
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    for cap in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(cap, raising=False)
    return cpuinfo


def test_no_source_finds_bf16(no_sources: Path) -> None:
    assert cpu_bf16() is None


@pytest.mark.parametrize(("capabilities", "feature"), [
    ({"amx_bf16": True, "amx_tile": True, "avx512_bf16": True}, "AMX-BF16"),
    ({"amx_bf16": False, "avx512_bf16": True}, "AVX512-BF16"),
    ({"architecture": "arm64", "bf16": True, "sve_bf16": True}, "ARM BF16"),
    ({"architecture": "x86_64", "avx2": True, "avx512_bf16": False}, None),
])
def test_torch_capabilities_come_first(monkeypatch: pytest.MonkeyPatch, no_sources: Path,
                                       capabilities: dict[str, object], feature: str | None) -> None:
    no_sources.write_text(AVX2_ONLY)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)
    assert cpu_bf16() == feature


@pytest.mark.parametrize(("feature", "max_isa", "usable"), [
    ("AVX512-BF16", None, "AVX512-BF16"),
    ("AVX512-BF16", "AVX2", None),  # oneDNN held below bf16: emulated, whatever the CPU has
    ("AVX512-BF16", "avx512_core_vnni", None),
    ("AVX512-BF16", "AVX512_CORE_BF16", "AVX512-BF16"),
    ("AMX-BF16", "AVX512_CORE_BF16", "AVX512-BF16"),  # AMX held back: its AVX512-BF16 is left
    ("AMX-BF16", "ALL", "AMX-BF16"),
    ("ARM BF16", "AVX2", "ARM BF16"),  # not an x86 ISA
])
def test_onednn_max_cpu_isa_caps_what_bf16_onednn_may_use(feature: str, max_isa: str | None,
                                                           usable: str | None) -> None:
    assert onednn_capped(feature, max_isa) == usable


def test_an_isa_cap_in_the_environment_is_read(monkeypatch: pytest.MonkeyPatch, no_sources: Path) -> None:
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": True})
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpu_bf16() is None


def test_torch_probe_beats_cpuinfo(monkeypatch: pytest.MonkeyPatch, no_sources: Path) -> None:
    no_sources.write_text(ZEN4)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"amx_bf16": True})
    assert cpu_bf16() == "AMX-BF16"


def test_cpuinfo_is_read_when_torch_finds_nothing(no_sources: Path) -> None:
    no_sources.write_text(ZEN4)
    assert cpu_bf16() == "AVX512-BF16"


def _broken() -> object:
    raise RuntimeError("no cpuinfo in this build")


def test_a_failing_torch_probe_falls_back_to_the_private_probes(monkeypatch: pytest.MonkeyPatch,
                                                                no_sources: Path) -> None:
    monkeypatch.setattr(torch.cpu, "get_capabilities", _broken)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert cpu_bf16() == "AMX-BF16"


def test_older_torch_private_probes(monkeypatch: pytest.MonkeyPatch, no_sources: Path) -> None:
    """torch before `get_capabilities`: only `_is_amx_tile_supported` / `_is_avx512_bf16_supported`."""
    monkeypatch.delattr(torch.cpu, "get_capabilities")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    assert cpu_bf16() == "AVX512-BF16"


def test_torch_without_any_probe_uses_cpuinfo(monkeypatch: pytest.MonkeyPatch, no_sources: Path) -> None:
    for name in ("get_capabilities", "_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        monkeypatch.delattr(torch.cpu, name, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", _broken, raising=False)
    no_sources.write_text(SAPPHIRE_RAPIDS)
    assert cpu_bf16() == "AMX-BF16"


def test_unreadable_cpuinfo_is_silent(no_sources: Path) -> None:
    no_sources.mkdir()  # reading a directory raises IsADirectoryError (an OSError)
    assert cpu_bf16() is None


def test_cpuinfo_is_only_read_on_linux(monkeypatch: pytest.MonkeyPatch, no_sources: Path) -> None:
    no_sources.write_text(ZEN4)
    monkeypatch.setattr(sys, "platform", "win32")
    assert cpu_bf16() is None


class FakeRun:
    def __init__(self, stdout: str = "", returncode: int = 0, error: BaseException | None = None) -> None:
        self.stdout, self.returncode, self.error = stdout, returncode, error
        self.calls: list[tuple[list[str], dict[str, Any]]] = []

    def __call__(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append((argv, kwargs))
        if self.error is not None:
            raise self.error
        return subprocess.CompletedProcess(argv, self.returncode, self.stdout, "")


@pytest.mark.parametrize(("run", "feature"), [
    (FakeRun("1\n"), "ARM BF16"),
    (FakeRun("0\n"), None),  # M1: no FEAT_BF16
    (FakeRun("", returncode=1), None),  # older macOS: unknown sysctl name
    (FakeRun(error=FileNotFoundError("sysctl")), None),
    (FakeRun(error=subprocess.TimeoutExpired("sysctl", 2.0)), None),
])
def test_macos_sysctl(monkeypatch: pytest.MonkeyPatch, no_sources: Path, run: FakeRun, feature: str | None) -> None:
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    monkeypatch.setattr(subprocess, "run", run)
    assert cpu_bf16() == feature
    [(argv, kwargs)] = run.calls
    assert argv == ["sysctl", "-n", "hw.optional.arm.FEAT_BF16"]
    assert kwargs["timeout"] > 0 and kwargs["check"] is False


def test_sysctl_only_runs_on_macos(monkeypatch: pytest.MonkeyPatch, no_sources: Path) -> None:
    run = FakeRun("1\n")
    monkeypatch.setattr(subprocess, "run", run)
    assert cpu_bf16() is None
    assert run.calls == []


def test_a_raising_source_is_skipped_and_the_result_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def broken() -> str | None:
        calls.append("broken")
        raise ValueError("unexpected")

    def found() -> str | None:
        calls.append("found")
        return "ARM BF16"

    monkeypatch.setattr(cpufeatures, "_CPU_BF16_SOURCES", (broken, found))
    assert cpu_bf16() == "ARM BF16"
    assert cpu_bf16() == "ARM BF16"
    assert calls == ["broken", "found"]  # probed once


def test_this_machine_answers_without_raising() -> None:
    assert cpu_bf16() in (None, "AMX-BF16", "AVX512-BF16", "ARM BF16")


# --- device_caps on the CPU and elsewhere ------------------------------------------------------------------------


@pytest.mark.parametrize("feature", ["AMX-BF16", "AVX512-BF16", "ARM BF16", None])
def test_device_caps_cpu_from_cpu_bf16(monkeypatch: pytest.MonkeyPatch, feature: str | None) -> None:
    monkeypatch.setattr(cpufeatures, "cpu_bf16", lambda: feature)
    caps = device_caps(torch.device("cpu"))
    assert caps == DeviceCaps("cpu", None, bf16=feature is not None, bf16_source=feature)
    assert resolve_precision("auto", caps).name == ("32-true" if feature is None else "bf16-mixed")


def test_device_caps_other_devices_have_no_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpufeatures, "cpu_bf16", lambda: "AMX-BF16")  # the host CPU's bf16 is not the device's
    assert device_caps(torch.device("mps")) == DeviceCaps("mps")
    assert device_caps(torch.device("meta")) == DeviceCaps("meta")
