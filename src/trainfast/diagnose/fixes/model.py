"""Ranked fixes: pure functions from the evidence to recommendations with a measured why and an expected gain
(recommendation.py: what a fix is and the basis of its gain). The model step's and the collectives' rules are here;
the input pipeline's are in input_fixes.py; `recommend` runs them all (`RULES`) and ranks what they found.
"""

from __future__ import annotations

from typing import Any

from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.fixes.rule import MIN_GAIN, NEEDS_EDIT, VERIFY_IT, measured_faster, speedup_of_part
from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.verdict import DATA_WAIT_BOUND, HOST_BOUND

# Mixed precision on tensor cores; NVIDIA reports 2.6x for ResNet-50 training on an A100. Use a
# conservative 2x for the compute part of an unknown model.
AMP_COMPUTE_SPEEDUP = 2.0


# bf16 autocast on a CPU with native bf16: the Trainer's A/B measured 1.36-1.79x fp32 for the demo ConvNet's step
# on a 2-core AVX512-BF16 EPYC (six runs); the low end for an unknown model.
CPU_BF16_COMPUTE_SPEEDUP = 1.4


# torch.compile: +43 % geomean training speed-up on A100 in PyTorch's 2.0 benchmark suite.
COMPILE_COMPUTE_SPEEDUP = 1.43


# channels_last: 1.6x for the demo ConvNet's step on this project's 2-core CPU (oneDNN); NVIDIA's
# guidance for mixed-precision convs on tensor cores is of the order of 1.2x.
CHANNELS_LAST_CPU_SPEEDUP = 1.5


CHANNELS_LAST_GPU_SPEEDUP = 1.2


def threads(e: Evidence) -> Recommendation | None:
    """A thread count the replay measured faster than the script's (more threads for a step that set fewer)."""
    if e.device != "cpu" or e.trials is None or any(s.num_workers for s in e.loaders):
        return None  # with workers, the cores are shared: cpu_threads and num_workers weigh that
    faster = [t for key, t in e.trials.trials.items() if key.startswith("threads:") and t.faster
              and t.value > e.threads]
    best = max(faster, key=lambda t: t.factor, default=None)
    gain = best.gain(e.fractions.compute, e.compute_s) if best is not None else None
    if best is None or gain is None or gain < MIN_GAIN:
        return None
    return Recommendation(
        "threads", f"Give the model step {best.value} intra-op threads (now {e.threads})",
        f"the model's forward and backward took {1 / best.factor:.2f}x as long on {best.value} threads as on "
        f"{e.threads} ({best.spread()}, measured on its own input)",
        f"torch.set_num_threads({best.value})  # or TrainConfig(cpu_threads='auto')", gain,
        overrides={"threads": best.value}, gain_basis="measured")


def _unprobed(e: Evidence, trial: Any) -> str | None:
    """Why the doctor could not time a candidate it tried (its own step failed, or the model could not be replayed):
    then no assumed gain is given either."""
    if trial is not None and trial.failed:
        return f"the doctor could not time it: {trial.reason}"
    if trial is None and e.trials is not None and e.trials.reason:
        return f"the doctor could not time it: {e.trials.reason}"
    return None


def _trial_or_reason(e: Evidence, key: str) -> tuple[Any, str | None]:
    """The replay's trial of a candidate (probe.py), or why there is none."""
    if e.trials is None:
        return None, "no replay of the model was tried"
    trial = e.trials.get(key)
    if trial is None:
        return None, e.trials.reason or "the replay did not try it"
    return trial, trial.reason


def amp(e: Evidence) -> Recommendation | None:
    cpu_bf16 = e.device == "cpu" and e.bf16_supported  # AMX / AVX512-BF16 / ARM BF16
    if (e.device != "cuda" and not cpu_bf16) or e.autocast or e.fractions.compute < 0.3:
        return None
    if e.parameter_dtypes and e.parameter_dtypes != {"float32"}:
        return None  # autocast changes only float32 work (a float64 model stays float64)
    trial, reason = _trial_or_reason(e, "amp")
    fix = f"with torch.autocast('{e.device}', dtype=torch.bfloat16): loss = ...  # or TrainConfig(precision='auto')"
    unprobed = _unprobed(e, trial)
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
            "step. Check the loss curve", fix, gain, gain_basis="measured")
    if trial is not None and not trial.applies:  # autocast on float64, emulated bf16
        return None
    if cpu_bf16:
        dtype, title, speedup = "bfloat16", "bfloat16 on this CPU", CPU_BF16_COMPUTE_SPEEDUP
        why = "this CPU multiplies in bf16 natively"
    else:
        dtype = title = "bfloat16" if e.bf16_supported else "float16 with a GradScaler"
        speedup = AMP_COMPUTE_SPEEDUP
        why = f"tensor cores run {dtype.split()[0]} several times faster than fp32"
    if unprobed is not None:  # the doctor's own replay failed: no figure it could not measure
        return Recommendation(
            "amp", f"Train in mixed precision ({title})",
            f"no autocast was seen; compute is {e.fractions.compute:.0%} of each step and {why}; not measured here",
            fix, None, basis_reason=unprobed)
    return Recommendation(
        "amp", f"Train in mixed precision ({title})",
        f"no autocast was seen; compute is {e.fractions.compute:.0%} of each step and {why} (an estimate: assumed "
        f"{speedup}x on compute; check loss curves)", fix,
        speedup_of_part(e.fractions.compute, speedup), basis_reason=f"not measured: {reason}; {NEEDS_EDIT}")


def fp32(e: Evidence) -> Recommendation | None:
    """The script's own autocast, measured slower than float32 (a CPU that emulates bf16: 4.5-5.5x on a public
    image-classification script): the fix reverses its choice, ranked by its measured gain like any other."""
    measured = measured_faster(e, "fp32")
    if measured is None:
        return None
    trial, gain = measured
    dtype = next((d for kind, d in e.autocast if kind == e.device), "reduced-precision")
    native = ("bf16 is emulated here (no AMX or AVX512-BF16 that oneDNN may use)" if e.device == "cpu" and
              dtype == "bfloat16" and not e.bf16_supported else f"{dtype} does not pay on this device for this model")
    return Recommendation(
        "fp32", f"Train in float32: drop the {dtype} autocast",
        f"the script trains under {dtype} autocast, and {native}: the model's forward and backward ran "
        f"{trial.factor:.2f}x as fast in float32 ({trial.spread()}, measured on its own input), on the "
        f"{e.fractions.compute:.0%} of the step that is compute",
        f"remove the torch.autocast('{e.device}', dtype=torch.{dtype}) block (or the script's --amp flag)  # or "
        "TrainConfig(precision='auto'), which measures both", gain, overrides={"autocast": False},
        gain_basis="measured")


def bf16(e: Evidence) -> Recommendation | None:
    uses_fp16 = any(dtype == "float16" for _, dtype in e.autocast)
    if not uses_fp16 or not e.bf16_supported or not e.scaler_skip_fraction or e.scaler_skip_fraction < 0.01:
        return None
    return Recommendation(
        "bf16", "Use bfloat16 instead of float16",
        f"the GradScaler skipped {e.scaler_skip_fraction:.0%} of optimizer steps (inf/NaN gradients); bf16 has "
        "fp32's exponent range and needs no loss scaling, and this GPU supports it",
        "torch.autocast('cuda', dtype=torch.bfloat16) without a GradScaler  # or precision='bf16-mixed'",
        1 / (1 - min(e.scaler_skip_fraction, 0.9)), gain_basis="measured")


def compile_model(e: Evidence) -> Recommendation | None:
    if e.compiled and (e.recompiled_frames or e.graph_breaks):
        return Recommendation(
            "compile", "Remove recompilations and graph breaks",
            f"torch.compile recompiled {e.recompiled_frames} frame(s) during the measured steps and hit "
            f"{e.graph_breaks} graph break(s); each break runs eagerly, each recompile stalls training",
            "TORCH_LOGS=recompiles,graph_breaks python train.py  # then mark dynamic dims or move Python out of "
            "forward", None, basis_reason=f"what a break or recompile costs depends on the code; {NEEDS_EDIT}")
    if e.compiled or e.device != "cuda" or e.verdict != "compute-bound":
        return None
    return Recommendation(
        "compile", "Compile the model with torch.compile",
        f"the run is compute-bound ({e.fractions.compute:.0%} compute) and not compiled; fused kernels cut memory "
        f"traffic (assumed {COMPILE_COMPUTE_SPEEDUP}x on compute, PyTorch's training geomean)",
        "model = torch.compile(model)  # or TrainConfig(compile=True) / trainfast train --compile",
        speedup_of_part(e.fractions.compute, COMPILE_COMPUTE_SPEEDUP),
        basis_reason="compiling takes longer than the doctor's measurements may; TrainConfig(compile='auto') "
                     "measures it in training")


def channels_last(e: Evidence) -> Recommendation | None:
    nchw = e.conv_weights_nchw  # (weights whose strides fit both layouts say nothing)
    mixed = bool(e.autocast)
    if nchw <= 0 or e.input_layout == "channels_last" or e.fractions.compute < 0.3:
        return None  # already in use: the weights or the images the model receives are NHWC
    fix = ("model = model.to(memory_format=torch.channels_last); x = x.to(memory_format=torch.channels_last)  "
           "# or TrainConfig(channels_last='auto')")
    trial, reason = _trial_or_reason(e, "channels_last")
    if trial is not None and trial.measured:
        gain = trial.gain(e.fractions.compute, e.compute_s)
        if not trial.faster or gain is None or gain < MIN_GAIN:
            return None
        return Recommendation(
            "channels_last", "Use the channels_last (NHWC) memory format for the conv net",
            f"{nchw} conv weight(s) are NCHW; the model's forward and backward ran {trial.factor:.2f}x as fast in "
            f"NHWC ({trial.spread()}, measured on its own input), on the {e.fractions.compute:.0%} of the step that "
            "is compute", fix, gain, gain_basis="measured")
    if e.device == "cuda" and not mixed:
        return None
    unprobed = _unprobed(e, trial)
    if unprobed is not None:
        return Recommendation(
            "channels_last", "Use the channels_last (NHWC) memory format for the conv net",
            f"{nchw} conv weight(s) are NCHW; not measured here", fix, None, basis_reason=unprobed)
    factor = CHANNELS_LAST_CPU_SPEEDUP if e.device == "cpu" else CHANNELS_LAST_GPU_SPEEDUP
    where = "oneDNN's fast layout on the CPU" if e.device == "cpu" else "what tensor cores read under autocast"
    return Recommendation(
        "channels_last", "Use the channels_last (NHWC) memory format for the conv net",
        f"{nchw} conv weight(s) are NCHW; NHWC is {where} (an estimate: assumed {factor}x on the "
        f"{e.fractions.compute:.0%} of the step that is compute)", fix,
        speedup_of_part(e.fractions.compute, factor), basis_reason=f"not measured: {reason}; {NEEDS_EDIT}")


def contiguous(e: Evidence) -> Recommendation | None:
    """The script's channels_last, measured slower than NCHW (oneDNN and cuDNN lack fast NHWC kernels for some
    shapes): the fix reverses its choice, ranked by its measured gain like any other."""
    measured = measured_faster(e, "contiguous")
    if measured is None:
        return None
    trial, gain = measured
    return Recommendation(
        "contiguous", "Train in the NCHW layout: drop channels_last",
        f"the script trains in channels_last (NHWC); the model's forward and backward ran {trial.factor:.2f}x as "
        f"fast in NCHW ({trial.spread()}, measured on its own input), on the {e.fractions.compute:.0%} of the step "
        "that is compute", "remove model.to(memory_format=torch.channels_last) and the inputs' conversion (or the "
        "script's --channels-last flag)  # or TrainConfig(channels_last='auto'), which measures both", gain,
        gain_basis="measured")


def cudnn_benchmark(e: Evidence) -> Recommendation | None:
    if e.device != "cuda" or e.conv_weights == 0 or e.cudnn_benchmark:
        return None
    return Recommendation(
        "cudnn_benchmark", "Let cuDNN benchmark its convolution algorithms",
        f"{e.conv_weights} conv layer(s) with torch.backends.cudnn.benchmark=False: cuDNN uses a heuristic "
        "choice instead of timing the candidates once per input shape",
        "torch.backends.cudnn.benchmark = True  # when input shapes do not change every step", None,
        overrides={"cudnn_benchmark": True}, basis_reason=VERIFY_IT)


def host_sync(e: Evidence) -> Recommendation | None:
    # On the CPU a sync costs nothing. On a GPU, a sync costs the idle time while the host launches the next
    # kernels: with the host between steps under 5 % of the step (one loss.item() per step of a GPU-bound
    # loop, word_language_model's), there is nothing to gain.
    if e.syncs_per_step < 1 or e.device != "cuda" or e.fractions.host <= DATA_WAIT_BOUND:
        return None
    why = (f"{e.syncs_per_step:.1f} host-device sync(s) per step (.item(), float(t), .tolist()): each one "
           "drains the GPU queue, so the next step's kernels start late")
    gain = speedup_of_part(e.fractions.host, 4.0) if e.fractions.host > 0 else None
    return Recommendation(
        "host_sync", "Read metrics from the device every N steps, not every step", why,
        "running += loss.detach()  # and every 50 steps: print(running.item() / 50); running.zero_()", gain,
        basis_reason=f"assumed 4x less host time without the syncs; {NEEDS_EDIT}")


def batch_size(e: Evidence) -> Recommendation | None:
    if e.fractions.host <= HOST_BOUND or (e.gpu_memory_fraction is not None and e.gpu_memory_fraction > 0.5):
        return None
    memory = f"; peak GPU memory is {e.gpu_memory_fraction:.0%} of the card" if e.gpu_memory_fraction else ""
    return Recommendation(
        "batch_size", "Use a larger batch to amortise per-step overhead",
        f"{e.fractions.host:.0%} of each step is fixed per-step host work{memory}; doubling the batch halves it per "
        "sample (scale the learning rate with it)",
        "DataLoader(..., batch_size=2 * batch_size)  # and lr *= 2 (linear scaling) or sqrt(2)",
        speedup_of_part(e.fractions.host, 2.0),
        basis_reason=f"assumed the host work stays per step as the batch doubles; {NEEDS_EDIT}")


def cpu_threads_beside_workers(e: Evidence) -> int | None:
    """The intra-op threads that leave the loader's workers their cores, where workers and threads oversubscribe
    the CPUs the model trains on; None where they do not (or the count is already that low)."""
    workers = sum(s.num_workers for s in e.loaders)
    if e.device != "cpu" or workers == 0 or e.threads + workers <= e.cpus or (e.workers is not None and e.workers.wait):
        return None  # (workers that mostly wait seldom hold a core the step's threads need)
    chosen = max(1, e.cpus - workers)
    return chosen if chosen < e.threads else None  # (fewer there cannot be: the workers alone oversubscribe)


def cpu_threads(e: Evidence) -> Recommendation | None:
    """Workers and intra-op threads oversubscribing the cores when the model trains on the CPU: offered only where
    the model step at the fewer threads measured faster (fewer threads mostly cost more than the turns they save:
    1 thread instead of 2 measured 0.83-0.84x under --verify on two public scripts)."""
    chosen = cpu_threads_beside_workers(e)
    measured = measured_faster(e, f"threads:{chosen}") if chosen is not None else None
    if measured is None:
        return None  # unmeasured or measured no faster (`not_offered` says which)
    trial, gain = measured
    workers = sum(s.num_workers for s in e.loaders)
    return Recommendation(
        "cpu_threads", f"Give the model step {chosen} intra-op thread(s) (now {e.threads})",
        f"{workers} loader worker(s) and {e.threads} intra-op threads share {e.cpus} CPUs; the model's forward and "
        f"backward ran {trial.factor:.2f}x as fast on {chosen} thread(s) ({trial.spread()}, measured on its own "
        "input), and leave the workers their cores",
        f"torch.set_num_threads({chosen})  # or TrainConfig(cpu_threads='auto')", gain,
        overrides={"threads": chosen}, gain_basis="measured")
