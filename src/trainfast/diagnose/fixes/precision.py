"""The precision fixes: mixed precision where the script trains in float32 (timed on its own model where the
device runs the low precision natively), float32 where its own autocast measured slower (emulated bf16), bf16 where
fp16's loss scaler skips steps."""

from __future__ import annotations

from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.fixes.rule import (
    MIN_GAIN,
    NEEDS_EDIT,
    VERIFY_IT,
    Rule,
    measured_faster,
    register,
    speedup_of_part,
    trial_or_reason,
    unprobed,
)
from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.records.trials import TrialRequest

# Mixed precision on tensor cores; NVIDIA reports 2.6x for ResNet-50 training on an A100. Use a
# conservative 2x for the compute part of an unknown model.
AMP_COMPUTE_SPEEDUP = 2.0
# bf16 autocast on a CPU with native bf16: the Trainer's A/B measured 1.36-1.79x fp32 for the demo ConvNet's step
# on a 2-core AVX512-BF16 EPYC (six runs); the low end for an unknown model.
CPU_BF16_COMPUTE_SPEEDUP = 1.4
# What --verify injects for bf16: the trained model's forwards under bf16 autocast, its outputs back in float32
BF16 = {"autocast": "bfloat16"}
# fp16 needs a loss scale around the script's own backward and optimizer step, which no injection can place safely
FP16_NOT_INJECTED = "float16 is not injected: it needs a GradScaler around the script's own backward and step"


@register
class Amp(Rule):
    id = "amp"
    acts_on = "model step"
    changes = ("forward",)
    summary = ("mixed precision (bf16 autocast, or fp16 with a GradScaler: that one not injectable) where the script "
               "trains in float32")
    injects = ("autocast",)

    def trials(self, e: Evidence) -> tuple[TrialRequest, ...]:
        """bf16 (or fp16 on a GPU without it) autocast against the script's float32, where it can apply."""
        if e.autocast:
            return ()  # the script chose a precision: `Fp32` times it against float32
        if e.parameter_dtypes and e.parameter_dtypes != {"float32"}:
            return (TrialRequest("amp", "mixed precision", None, skip=f"the model's parameters are "
                                 f"{', '.join(sorted(e.parameter_dtypes))}: autocast changes only float32 work"),)
        if e.device == "cuda" or (e.device == "cpu" and e.bf16_supported):
            dtype = "bfloat16" if e.bf16_supported else "float16"
            return (TrialRequest("amp", f"{dtype} autocast", dtype),)
        if e.device == "cpu":
            return (TrialRequest("amp", "mixed precision", None, skip="bf16 is emulated here (no AMX or AVX512-BF16 "
                                 "that oneDNN may use): slower than fp32"),)
        return ()

    def propose(self, e: Evidence) -> Recommendation | None:
        cpu_bf16 = e.device == "cpu" and e.bf16_supported  # AMX / AVX512-BF16 / ARM BF16
        if (e.device != "cuda" and not cpu_bf16) or e.autocast or e.fractions.compute < 0.3:
            return None
        if e.parameter_dtypes and e.parameter_dtypes != {"float32"}:
            return None  # autocast changes only float32 work (a float64 model stays float64)
        trial, reason = trial_or_reason(e, "amp")
        fix = f"with torch.autocast('{e.device}', dtype=torch.bfloat16): loss = ...  # or TrainConfig(precision='auto')"
        failed = unprobed(e, trial)
        if trial is not None and trial.measured:
            gain = trial.gain(e.fractions.compute, e.compute_s)
            if not trial.faster or gain is None or gain < MIN_GAIN:
                return None  # measured no faster: `not_offered` says so
            dtype = str(trial.value)
            if dtype == "float16":
                fix = "with torch.autocast('cuda', dtype=torch.float16): ... and a torch.amp.GradScaler  # or " \
                      "TrainConfig(precision='auto')"
            return Recommendation(
                "amp", f"Train in mixed precision ({dtype})",
                f"no autocast was seen; the model's forward and backward ran {trial.factor:.2f}x as fast under {dtype} "
                f"autocast ({trial.spread()}, measured on its own input); compute is {e.fractions.compute:.0%} of each "
                "step. Check the loss curve" + ("" if dtype == "bfloat16" else f" ({FP16_NOT_INJECTED})"), fix, gain,
                overrides=BF16 if dtype == "bfloat16" else None, gain_basis="measured")
        if trial is not None and not trial.applies:  # autocast on float64, emulated bf16
            return None
        if cpu_bf16:
            dtype, title, speedup = "bfloat16", "bfloat16 on this CPU", CPU_BF16_COMPUTE_SPEEDUP
            why = "this CPU multiplies in bf16 natively"
        else:
            dtype = title = "bfloat16" if e.bf16_supported else "float16 with a GradScaler"
            speedup = AMP_COMPUTE_SPEEDUP
            why = f"tensor cores run {dtype.split()[0]} several times faster than fp32"
        overrides = BF16 if dtype == "bfloat16" else None
        how = VERIFY_IT if overrides else f"{FP16_NOT_INJECTED}; {NEEDS_EDIT}"
        if failed is not None:  # the doctor's own replay failed: no figure it could not measure
            return Recommendation(
                "amp", f"Train in mixed precision ({title})",
                f"no autocast was seen; compute is {e.fractions.compute:.0%} of each step and {why}; not measured here",
                fix, None, overrides=overrides, basis_reason=f"{failed}; {how}")
        return Recommendation(
            "amp", f"Train in mixed precision ({title})",
            f"no autocast was seen; compute is {e.fractions.compute:.0%} of each step and {why} (an estimate: assumed "
            f"{speedup}x on compute; check loss curves)", fix,
            speedup_of_part(e.fractions.compute, speedup), overrides=overrides,
            basis_reason=f"not measured: {reason}; {how}")


@register
class Fp32(Rule):
    id = "fp32"
    acts_on = "model step"
    changes = ("autocast",)
    summary = "float32 instead of the script's own autocast, where that measured slower (emulated bf16)"
    injects = ("autocast",)

    def trials(self, e: Evidence) -> tuple[TrialRequest, ...]:
        """The script's own autocast against float32: its choice is a candidate too."""
        dtype = next((d for kind, d in e.autocast if kind == e.device), None)
        return (TrialRequest("fp32", f"float32 (the script's {dtype} autocast off)", "float32"),) if dtype else ()

    def propose(self, e: Evidence) -> Recommendation | None:
        """The script's own autocast, measured slower than float32 (a CPU that emulates bf16: 4.5-5.5x on a public
        image-classification script): the fix reverses its choice, ranked by its measured gain like any other."""
        measured = measured_faster(e, "fp32")
        if measured is None:
            return None
        trial, gain = measured
        dtype = next((d for kind, d in e.autocast if kind == e.device), "reduced-precision")
        native = ("bf16 is emulated here (no AMX or AVX512-BF16 that oneDNN may use)" if e.device == "cpu" and
                  dtype == "bfloat16" and not e.bf16_supported
                  else f"{dtype} does not pay on this device for this model")
        return Recommendation(
            "fp32", f"Train in float32: drop the {dtype} autocast",
            f"the script trains under {dtype} autocast, and {native}: the model's forward and backward ran "
            f"{trial.factor:.2f}x as fast in float32 ({trial.spread()}, measured on its own input), on the "
            f"{e.fractions.compute:.0%} of the step that is compute",
            f"remove the torch.autocast('{e.device}', dtype=torch.{dtype}) block (or the script's --amp flag)  # or "
            "TrainConfig(precision='auto'), which measures both", gain, overrides={"autocast": False},
            gain_basis="measured")


@register
class Bf16(Rule):
    id = "bf16"
    acts_on = "model step"
    changes = ("autocast",)
    summary = "bfloat16 instead of float16 where the GradScaler skips steps for inf/NaN gradients"

    def propose(self, e: Evidence) -> Recommendation | None:
        uses_fp16 = any(dtype == "float16" for _, dtype in e.autocast)
        if not uses_fp16 or not e.bf16_supported or not e.scaler_skip_fraction or e.scaler_skip_fraction < 0.01:
            return None
        return Recommendation(
            "bf16", "Use bfloat16 instead of float16",
            f"the GradScaler skipped {e.scaler_skip_fraction:.0%} of optimizer steps (inf/NaN gradients); bf16 has "
            "fp32's exponent range and needs no loss scaling, and this GPU supports it",
            "torch.autocast('cuda', dtype=torch.bfloat16) without a GradScaler  # or precision='bf16-mixed'",
            1 / (1 - min(e.scaler_skip_fraction, 0.9)), gain_basis="measured")
