"""Numeric precision: the policy ("auto" | "bf16-mixed" | "16-mixed" | "32-true") and the loss scaler."""

from trainfast.precision.policy import (
    PRECISIONS,
    DeviceCaps,
    LossScaler,
    PrecisionPolicy,
    ScalerConfig,
    device_caps,
    resolve_precision,
)

__all__ = ["PRECISIONS", "DeviceCaps", "LossScaler", "PrecisionPolicy", "ScalerConfig", "device_caps",
           "resolve_precision"]
