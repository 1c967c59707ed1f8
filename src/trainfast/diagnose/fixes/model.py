"""The model step's fixes beside its precision (precision.py): intra-op threads, torch.compile, the memory layout,
cuDNN's algorithm search, host syncs, the batch size."""

from __future__ import annotations

from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.evidence.wholerun import RunEvidence
from trainfast.diagnose.fixes.rule import (
    MIN_GAIN,
    NEEDS_EDIT,
    VERIFY_IT,
    Rule,
    measured_faster,
    named_phase,
    register,
    speedup_of_part,
    trial_or_reason,
    unprobed,
)
from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.records.trials import TrialRequest
from trainfast.diagnose.verdict import DATA_WAIT_BOUND, HOST_BOUND
from trainfast.loader.auto import threads_beside_workers

# torch.compile: +43 % geomean training speed-up on A100 in PyTorch's 2.0 benchmark suite.
COMPILE_COMPUTE_SPEEDUP = 1.43
# channels_last: 1.6x for the demo ConvNet's step on this project's 2-core CPU (oneDNN); NVIDIA's
# guidance for mixed-precision convs on tensor cores is of the order of 1.2x.
CHANNELS_LAST_CPU_SPEEDUP = 1.5
CHANNELS_LAST_GPU_SPEEDUP = 1.2
# What --verify injects for it: the model and its 4-D inputs converted at its first training forward
CHANNELS_LAST = {"memory_format": "channels_last"}


@register
class Threads(Rule):
    id = "threads"
    acts_on = "model step"
    summary = "more intra-op threads for a model step on the CPU that set fewer than the cores (no loader workers)"
    injects = ("threads",)

    def trials(self, e: Evidence) -> tuple[TrialRequest, ...]:
        """On the CPU, the model step on every usable core."""
        return (TrialRequest("threads", f"{e.cpus} intra-op thread(s)", e.cpus),) if e.device == "cpu" else ()

    def propose(self, e: Evidence) -> Recommendation | None:
        """A thread count the replay measured faster than the script's (more threads for a step that set fewer)."""
        if e.device != "cpu" or e.trials is None or any(s.num_workers for s in e.loaders):
            return None  # with workers, the cores are shared: cpu_threads and num_workers weigh that
        faster = [t for key, t in e.trials.trials.items() if key.startswith("threads:") and t.faster
                  and isinstance(t.value, int) and t.value > e.threads]
        best = max(faster, key=lambda t: t.factor or 0.0, default=None)  # (a faster trial has a factor)
        gain = best.gain(e.fractions.compute, e.compute_s) if best is not None else None
        if best is None or best.factor is None or gain is None or gain < MIN_GAIN:
            return None
        return Recommendation(
            "threads", f"Give the model step {best.value} intra-op threads (now {e.threads})",
            f"the model's forward and backward took {1 / best.factor:.2f}x as long on {best.value} threads as on "
            f"{e.threads} ({best.spread()}, measured on its own input)",
            f"torch.set_num_threads({best.value})  # or TrainConfig(cpu_threads='auto')", gain,
            overrides={"threads": best.value}, gain_basis="measured")


@register
class CpuThreads(Rule):
    id = "cpu_threads"
    acts_on = "model step"
    summary = ("fewer intra-op threads where they and the loader's workers oversubscribe the cores, where measured "
               "faster")
    injects = ("threads",)

    def trials(self, e: Evidence) -> tuple[TrialRequest, ...]:
        """The model step at the thread count the workers would leave it."""
        chosen = _cpu_threads_beside_workers(e)
        return (TrialRequest("threads", f"{chosen} intra-op thread(s)", chosen),) if chosen is not None else ()

    def propose(self, e: Evidence) -> Recommendation | None:
        """Workers and intra-op threads oversubscribing the cores when the model trains on the CPU: offered only where
        the model step at the fewer threads measured faster (fewer threads mostly cost more than the turns they save:
        1 thread instead of 2 measured 0.83-0.84x under --verify on two public scripts)."""
        chosen = _cpu_threads_beside_workers(e)
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


def _cpu_threads_beside_workers(e: Evidence) -> int | None:
    """The intra-op threads that leave the loader's workers their cores, where workers and threads oversubscribe
    the CPUs the model trains on; None where they do not (or the count is already that low)."""
    workers = sum(s.num_workers for s in e.loaders)
    if e.device != "cpu" or workers == 0 or e.threads + workers <= e.cpus or (e.workers is not None and e.workers.wait):
        return None  # (workers that mostly wait seldom hold a core the step's threads need)
    chosen = threads_beside_workers(e.cpus, workers)
    return chosen if chosen < e.threads else None  # (fewer there cannot be: the workers alone oversubscribe)


@register
class Compile(Rule):
    id = "compile"
    acts_on = "model step"
    changes = ("to", "model")
    summary = ("torch.compile for a compute-bound step (on a CPU measured by --verify only); its recompilations and "
               "graph breaks; over a whole run, the time compiling took")
    injects = ("compile",)

    def propose(self, e: Evidence) -> Recommendation | None:
        if e.compiled and (e.recompiled_frames or e.graph_breaks):
            return Recommendation(
                "compile", "Remove recompilations and graph breaks",
                f"torch.compile recompiled {e.recompiled_frames} frame(s) during the measured steps and hit "
                f"{e.graph_breaks} graph break(s); each break runs eagerly, each recompile stalls training",
                "TORCH_LOGS=recompiles,graph_breaks python train.py  # then mark dynamic dims or move Python out of "
                "forward", None, basis_reason=f"what a break or recompile costs depends on the code; {NEEDS_EDIT}")
        if e.compiled or e.device not in ("cuda", "cpu") or e.verdict != "compute-bound":
            return None
        fix = "model = torch.compile(model)  # or TrainConfig(compile=True) / trainfast train --compile"
        if e.device == "cpu":  # no published figure for inductor's CPU kernels to lean on: --verify times it
            return Recommendation(
                "compile", "Compile the model with torch.compile",
                f"the run is compute-bound ({e.fractions.compute:.0%} compute) and not compiled; what inductor's "
                "fused CPU kernels gain depends on the model", fix, None, overrides={"compile": True},
                basis_reason=f"not measured: compiling takes longer than the doctor's window; {VERIFY_IT}")
        return Recommendation(
            "compile", "Compile the model with torch.compile",
            f"the run is compute-bound ({e.fractions.compute:.0%} compute) and not compiled; fused kernels cut memory "
            f"traffic (assumed {COMPILE_COMPUTE_SPEEDUP}x on compute, PyTorch's training geomean)", fix,
            speedup_of_part(e.fractions.compute, COMPILE_COMPUTE_SPEEDUP), overrides={"compile": True},
            basis_reason=f"compiling takes longer than the doctor's window; {VERIFY_IT}")

    def propose_run(self, e: Evidence, run: RunEvidence) -> Recommendation | None:
        """The compilation's seconds over the whole run, named (no gain claimed), beside the step's fix."""
        if run.seconds["compile"] <= 0:
            return None
        return named_phase("compile", "Compilation", f"torch.compile took {run.seconds['compile']:.1f} s "
                           f"({run.share['compile']:.0%}) of the first steps: a compile cache "
                           "(TORCHINDUCTOR_FX_GRAPH_CACHE=1, on by default in recent torch; "
                           "torch.compiler.save_cache_artifacts) keeps it for the next run")


@register
class ChannelsLast(Rule):
    id = "channels_last"
    acts_on = "model step"
    changes = ("to", "model")
    summary = "the channels_last (NHWC) memory format for a conv net, where measured faster"
    injects = ("memory_format",)

    def trials(self, e: Evidence) -> tuple[TrialRequest, ...]:
        return (TrialRequest("channels_last", "channels_last", True),) if _nchw_convs(e) else ()

    def propose(self, e: Evidence) -> Recommendation | None:
        nchw = e.conv_weights_nchw  # (weights whose strides fit both layouts say nothing)
        mixed = bool(e.autocast)
        if nchw <= 0 or e.input_layout == "channels_last" or e.fractions.compute < 0.3:
            return None  # already in use: the weights or the images the model receives are NHWC
        fix = ("model = model.to(memory_format=torch.channels_last); x = x.to(memory_format=torch.channels_last)  "
               "# or TrainConfig(channels_last='auto')")
        trial, reason = trial_or_reason(e, "channels_last")
        if trial is not None and trial.measured:
            gain = trial.gain(e.fractions.compute, e.compute_s)
            if not trial.faster or gain is None or gain < MIN_GAIN:
                return None
            return Recommendation(
                "channels_last", "Use the channels_last (NHWC) memory format for the conv net",
                f"{nchw} conv weight(s) are NCHW; the model's forward and backward ran {trial.factor:.2f}x as fast in "
                f"NHWC ({trial.spread()}, measured on its own input), on the {e.fractions.compute:.0%} of the step "
                "that is compute", fix, gain, overrides=CHANNELS_LAST, gain_basis="measured")
        if e.device == "cuda" and not mixed:
            return None
        failed = unprobed(e, trial)
        if failed is not None:
            return Recommendation(
                "channels_last", "Use the channels_last (NHWC) memory format for the conv net",
                f"{nchw} conv weight(s) are NCHW; not measured here", fix, None, overrides=CHANNELS_LAST,
                basis_reason=failed)
        factor = CHANNELS_LAST_CPU_SPEEDUP if e.device == "cpu" else CHANNELS_LAST_GPU_SPEEDUP
        where = "oneDNN's fast layout on the CPU" if e.device == "cpu" else "what tensor cores read under autocast"
        return Recommendation(
            "channels_last", "Use the channels_last (NHWC) memory format for the conv net",
            f"{nchw} conv weight(s) are NCHW; NHWC is {where} (an estimate: assumed {factor}x on the "
            f"{e.fractions.compute:.0%} of the step that is compute)", fix,
            speedup_of_part(e.fractions.compute, factor), overrides=CHANNELS_LAST,
            basis_reason=f"not measured: {reason}; {VERIFY_IT}")


@register
class Contiguous(Rule):
    id = "contiguous"
    acts_on = "model step"
    changes = ("to", "model")
    summary = "NCHW instead of the script's own channels_last, where that measured slower"
    injects = ("memory_format",)

    def trials(self, e: Evidence) -> tuple[TrialRequest, ...]:
        """The script's own channels_last against NCHW: its choice is a candidate too."""
        in_use = e.input_layout == "channels_last" or e.conv_weights_channels_last > 0
        return (TrialRequest("contiguous", "the NCHW layout (the script's channels_last off)", True),) \
            if in_use and not _nchw_convs(e) else ()

    def propose(self, e: Evidence) -> Recommendation | None:
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
            overrides={"memory_format": "contiguous"}, gain_basis="measured")


def _nchw_convs(e: Evidence) -> int:
    """The conv weights channels_last would change, where the model's images are not NHWC already."""
    return 0 if e.input_layout == "channels_last" else e.conv_weights_nchw


@register
class CudnnBenchmark(Rule):
    id = "cudnn_benchmark"
    acts_on = "model step"
    summary = "cuDNN's benchmarked convolution algorithms instead of its heuristic choice"
    injects = ("cudnn_benchmark",)

    def propose(self, e: Evidence) -> Recommendation | None:
        if e.device != "cuda" or e.conv_weights == 0 or e.cudnn_benchmark:
            return None
        return Recommendation(
            "cudnn_benchmark", "Let cuDNN benchmark its convolution algorithms",
            f"{e.conv_weights} conv layer(s) with torch.backends.cudnn.benchmark=False: cuDNN uses a heuristic "
            "choice instead of timing the candidates once per input shape",
            "torch.backends.cudnn.benchmark = True  # when input shapes do not change every step", None,
            overrides={"cudnn_benchmark": True}, basis_reason=VERIFY_IT)


@register
class HostSync(Rule):
    id = "host_sync"
    acts_on = "model step"
    summary = "metrics read from the GPU every N steps, not every step (each read drains its queue)"

    def propose(self, e: Evidence) -> Recommendation | None:
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


@register
class BatchSize(Rule):
    id = "batch_size"
    acts_on = "model step"
    changes = ("loader",)
    summary = "a larger batch where fixed per-step host work takes a fifth of the step or more"

    def propose(self, e: Evidence) -> Recommendation | None:
        if e.fractions.host <= HOST_BOUND or (e.gpu_memory_fraction is not None and e.gpu_memory_fraction > 0.5):
            return None
        memory = f"; peak GPU memory is {e.gpu_memory_fraction:.0%} of the card" if e.gpu_memory_fraction else ""
        return Recommendation(
            "batch_size", "Use a larger batch to amortise per-step overhead",
            f"{e.fractions.host:.0%} of each step is fixed per-step host work{memory}; doubling the batch halves it "
            "per sample (scale the learning rate with it)",
            "DataLoader(..., batch_size=2 * batch_size)  # and lr *= 2 (linear scaling) or sqrt(2)",
            speedup_of_part(e.fractions.host, 2.0),
            basis_reason=f"assumed the host work stays per step as the batch doubles; {NEEDS_EDIT}")
