"""`PrecisionPolicy`: which numeric precision to train in, resolved once from the device's abilities.

"auto" picks bf16-mixed on CUDA devices that support bf16 (Ampere and newer: same exponent range as
fp32, so no loss scaling), 16-mixed with a GradScaler on older CUDA devices, bf16-mixed on CPUs with a
native bf16 matmul (AMX-BF16, AVX512-BF16, ARM BF16; see `cpufeatures.cpu_bf16`), and 32-true on other CPUs and
other device types (mps, ...). An explicit 'bf16-mixed' on a CPU without native bf16 is allowed: torch
emulates it, usually slower than fp32. Only `torch.amp` is used; `torch.cuda.amp` is deprecated.
"""

from __future__ import annotations

import itertools
import logging
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Literal

import torch

from trainfast.precision import cpufeatures
from trainfast.precision.cpufeatures import CPU_BF16_FEATURES

PrecisionName = Literal["auto", "bf16-mixed", "16-mixed", "32-true"]
PRECISIONS: tuple[str, ...] = ("auto", "bf16-mixed", "16-mixed", "32-true")
log = logging.getLogger("trainfast")
_NO_AUTOCAST: AbstractContextManager[object] = nullcontext()


@dataclass(frozen=True, kw_only=True)
class ScalerConfig:
    """GradScaler knobs (torch's defaults). Lower `init_scale` if the first steps are all skipped."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if not (self.init_scale > 0 and self.growth_factor > 1 and 0 < self.backoff_factor < 1
                and self.growth_interval >= 1):
            raise ValueError(f"invalid {self}: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, "
                             "growth_interval >= 1")


@dataclass(frozen=True)
class DeviceCaps:
    """What the precision choice depends on; read from the device, faked in tests."""

    device_type: str
    capability: tuple[int, int] | None = None  # CUDA compute capability
    bf16: bool = False  # native (not emulated) bf16 math
    bf16_source: str | None = None  # what provides it: "compute capability 8.0", "AVX512-BF16", ...


# Ampere's compute capability: native bf16 and TF32 tensor-core math start here (older GPUs emulate bf16, slowly).
AMPERE = (8, 0)

def device_caps(device: torch.device) -> DeviceCaps:
    if device.type == "cpu":
        feature = cpufeatures.cpu_bf16()
        return DeviceCaps("cpu", None, feature is not None, feature)
    if device.type != "cuda":
        return DeviceCaps(device.type)
    # From `device`'s own capability: torch.cuda.is_bf16_supported() asks the *current* device, which on a
    # host with mixed GPUs may be another model than the one trained on.
    capability = torch.cuda.get_device_capability(device)
    bf16 = capability >= AMPERE
    return DeviceCaps("cuda", capability, bf16, f"compute capability {capability[0]}.{capability[1]}" if bf16 else None)


@dataclass(frozen=True)
class PrecisionPolicy:
    """A resolved precision: autocast dtype (None = fp32), whether a loss scaler is needed, TF32."""

    name: str
    device_type: str
    autocast_dtype: torch.dtype | None
    needs_scaler: bool
    tf32: bool  # TF32 matmuls and convs (Ampere+: ~8x the fp32 matmul rate, 10-bit mantissa)
    reason: str

    def autocast(self) -> AbstractContextManager[object]:
        if self.autocast_dtype is None:
            return _NO_AUTOCAST  # reusable: no object built per step
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)


def resolve_precision(requested: str, caps: DeviceCaps) -> PrecisionPolicy:
    """Pure: the policy for `requested` on a device with `caps`. Raises ValueError for impossible choices."""
    if requested not in PRECISIONS:
        raise ValueError(f"precision={requested!r} is not valid; choose one of: {', '.join(PRECISIONS)}")
    cuda = caps.device_type == "cuda"
    ampere = cuda and caps.capability is not None and caps.capability >= AMPERE
    cpu = caps.device_type == "cpu"
    name, why = requested, "requested"
    if requested == "auto":
        if cpu and caps.bf16:
            source = f" ({caps.bf16_source})" if caps.bf16_source else ""
            name, why = "bf16-mixed", f"CPU has native bf16{source}: bf16 autocast, fp32 weights, no loss scaling"
        elif cpu:
            name, why = "32-true", f"CPU has no native bf16 matmul ({CPU_BF16_FEATURES}): fp32"
        elif not cuda:
            name, why = "32-true", f"{caps.device_type} device: fp32 (auto mixes precision only on CUDA and on CPUs " \
                                   "with native bf16)"
        elif caps.bf16:
            name, why = "bf16-mixed", f"CUDA capability {caps.capability} supports bf16: fp32 range, no loss scaling"
        else:
            name, why = "16-mixed", f"CUDA capability {caps.capability} lacks bf16: fp16 with a GradScaler"
    if name == "bf16-mixed" and cuda and not caps.bf16:
        raise ValueError(f"precision='bf16-mixed' needs a bf16-capable GPU; capability {caps.capability} is not. "
                         "Use '16-mixed' (fp16 with loss scaling) or 'auto'")
    if requested == "bf16-mixed" and cpu and not caps.bf16:
        why = (f"requested; this CPU has no native bf16 matmul ({CPU_BF16_FEATURES}): torch emulates bf16, likely "
               "slower than fp32")
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(name)
    # An explicit '32-true' means full fp32 matmuls; otherwise TF32 is free speed on Ampere and newer.
    return PrecisionPolicy(name=name, device_type=caps.device_type, autocast_dtype=dtype,
                           needs_scaler=name == "16-mixed", tf32=ampere and requested != "32-true", reason=why)


class LossScaler:
    """A `torch.amp.GradScaler` that also counts skipped steps on the device (no host sync per step)."""

    def __init__(self, device: torch.device, enabled: bool, config: ScalerConfig | None = None) -> None:
        cfg = config or ScalerConfig()
        self.enabled = enabled
        self.scaler = torch.amp.GradScaler(device.type, init_scale=cfg.init_scale, growth_factor=cfg.growth_factor,
                                           backoff_factor=cfg.backoff_factor, growth_interval=cfg.growth_interval,
                                           enabled=enabled)
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.enabled else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self.enabled:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.enabled:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        # found_inf is only kept until update(): add it now, on the device.
        for found in self.scaler._found_inf_per_device(optimizer).values():
            self._skipped += found.to(self._skipped.device, torch.int64)
        self.scaler.update()

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because gradients were inf/NaN (reading it synchronises)."""
        return int(self._skipped.item())

    @property
    def loss_scale(self) -> float:
        return float(self.scaler.get_scale()) if self.enabled else 1.0

    def state_dict(self) -> dict[str, object]:
        return {"scaler": self.scaler.state_dict(), "skipped": self._skipped.cpu()}

    def load_state_dict(self, state: dict[str, object]) -> bool:
        """Restore a saved scale and skipped-step count: True if done; False, changing nothing, if either side
        has no scale.

        A disabled scaler (bf16 or fp32 training) saves an empty state: resuming such a checkpoint where fp16 is
        now chosen keeps this scaler's fresh scale (`GradScaler` itself raises on the empty state). A disabled
        scaler has no use for a saved scale.
        """
        if not self.enabled or not state.get("scaler"):
            return False
        self.scaler.load_state_dict(state["scaler"])  # type: ignore[arg-type]
        self._skipped.copy_(state["skipped"])  # type: ignore[arg-type]
        return True


FALLING_LOG_POINTS = 3  # the scale fell at this many log points in a row: overflow is the rule, not the scale settling


class ScaleWatch:
    """AMP health: the loss scale read at each log point; says once when it keeps falling.

    A GradScaler halves its scale at every overflowing step and doubles it after `growth_interval` clean ones,
    so a scale that falls log point after log point means fp16 keeps overflowing, and steps keep being skipped.
    """

    def __init__(self, bf16_here: bool, falls: int = FALLING_LOG_POINTS) -> None:
        self.bf16_here, self.falls = bf16_here, falls
        self.scales: list[float] = []
        self.warned = False

    def observe(self, scale: float) -> str | None:
        """Record the scale at a log point; the warning to log, the first time it fell `falls` times running."""
        self.scales.append(scale)
        recent = self.scales[-(self.falls + 1):]
        falling = len(recent) == self.falls + 1 and all(b < a for a, b in itertools.pairwise(recent))
        if not falling or self.warned:
            return None
        self.warned = True
        fix = ("use precision='bf16-mixed' (this device runs bf16 natively: fp32's range, no loss scaling)"
               if self.bf16_here else
               "lower lr, keep grad_clip on and check the inputs for very large values (this device has no "
               "native bf16)")
        return (f"the fp16 loss scale fell at each of the last {self.falls} log points ({recent[0]:g} -> "
                f"{scale:g}): gradients keep overflowing fp16 and those steps are skipped; {fix}")
