"""Ranked fixes: pure functions from the evidence to recommendations with a measured why and an expected gain.

`expected_gain` is the throughput ratio after the fix (1.8 = 1.8x the samples/s); None where no honest figure
exists. Its `gain_basis` says where it comes from:
- "measured": every factor in it was timed in this run: the step's own split (data wait, host, startup), or the
  candidate replayed on the script's own model and input (probe.py: mixed precision, channels_last, threads);
- "verified": `--verify` re-ran the script with the fix (verify.py sets it);
- "estimate": a factor from elsewhere (a named constant below, with its source), with `basis_reason` saying why
  nothing was measured. An estimate never outranks a measurement, and a candidate measured no faster is not
  offered at all (`not_offered` says so in a note).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainfast.diagnose.classify import DATA_WAIT_BOUND, HOST_BOUND, REPLAY_POSSIBLE
from trainfast.diagnose.evidence import Evidence, LoaderStats, main_loader
from trainfast.diagnose.probe import MARGIN
from trainfast.units import MIB, format_bytes

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
# The in-memory path batches by index gathers: 10.7x the batches/s of DataLoader(TensorDataset) here.
IN_MEMORY_SPEEDUP = 10.0
# Draft JPEG decode + uint8: 0.90 vs 1.63 ms per image on the demo images (BENCHMARKS.md): 45 % less work.
DRAFT_DECODE_SAVING = 0.45
# /dev/shm holds each worker's prefetched batches and the one being written.
SHM_MARGIN = 2
# A fix estimated below this is within the noise of a re-measurement: not worth proposing.
MIN_GAIN = 1.02
# Most worker processes proposed for workers that wait: each forked worker costs ~60 ms to start and its own
# interpreter's memory; past this, threads in one process (trainfast.make_loader) hide the latency more cheaply.
MAX_WAITING_WORKERS = 64
# Workers queued for a core this share of their time take turns on the cores: fewer of them is worth saying.
QUEUED_CONTEND = 0.2


@dataclass(frozen=True)
class Recommendation:
    id: str
    title: str
    why: str
    fix: str
    expected_gain: float | None
    # What `trainfast doctor --verify` injects to measure the fix without editing the script (None: it can't):
    # DataLoader keyword arguments (num_workers, pin_memory, persistent_workers, prefetch_factor) and
    # "threads" (intra-op threads), "cudnn_benchmark", "tf32".
    overrides: dict[str, Any] | None = field(default=None, compare=False)
    measured_gain: float | None = None  # samples/s with the fix / without it, both re-run (--verify)
    gain_basis: str = "estimate"  # "measured", "verified" or "estimate" (module doc)
    basis_reason: str | None = None  # an estimate's: why nothing was measured
    # `doctor --whole-run`: the gain on the whole run's wall time (Amdahl on the phase's share: runfixes.py)
    run_gain: float | None = None

    def to_json(self) -> dict[str, object]:
        return {"id": self.id, "title": self.title, "why": self.why, "fix": self.fix,
                "expected_gain": None if self.expected_gain is None else round(self.expected_gain, 3),
                "measured_gain": None if self.measured_gain is None else round(self.measured_gain, 3),
                "run_gain": None if self.run_gain is None else round(self.run_gain, 3),
                "gain_basis": self.gain_basis, "gain_basis_reason": self.basis_reason,
                "overrides": self.overrides}


# Why an estimate is one, for the fixes no replay can time
VERIFY_IT = "--verify re-runs the script with it"
NEEDS_EDIT = "it needs a change to the script, which the doctor cannot make to time it"


def _speedup_of_part(share: float, factor: float) -> float:
    """Whole-step gain when a part taking `share` of the step gets `factor` times faster (Amdahl)."""
    return 1.0 / (1.0 - share + share / factor)


def _main_loader(e: Evidence) -> LoaderStats | None:
    return main_loader(e.loaders)


def num_workers(e: Evidence) -> Recommendation | None:
    loader = _main_loader(e)
    if loader is None or loader.in_memory or e.fractions.data_wait <= DATA_WAIT_BOUND:
        return None
    if e.loader_headroom is not None and e.loader_headroom > REPLAY_POSSIBLE:
        return None  # the loader alone is far faster than training: its wait is jitter, not throughput
    if e.workers is not None and e.workers.wait:  # their batches arrive in bursts: the mean step is the rate
        mean = e.step_mean_s or e.step_s
        return _overlap_waits(e, loader, e.fractions.data_wait * mean, (1 - e.fractions.data_wait) * mean)
    wait, compute = e.fractions.data_wait * e.step_s, (1 - e.fractions.data_wait) * e.step_s
    k0 = loader.num_workers
    # Time one worker needs per batch: with k0 workers the loader delivers a batch every wait+compute.
    per_batch = wait if k0 == 0 else k0 * (wait + compute)
    cap = e.cpus - 1 if e.device == "cuda" else e.cpus  # one core stays with the process feeding the GPU
    k = min(max(1, cap), max(k0 + 1, math.ceil(per_batch / max(compute, 1e-9))))
    if k <= k0:
        return None
    new_step = max(compute, per_batch / k)
    caveat, threads = "", ""
    thread_override: dict[str, int] = {}  # for --verify: the thread count the fix sets, when it sets one
    if e.device == "cpu":  # loading and the model step share the same cores
        proposed = max(1, e.cpus - k)
        fewer = proposed < e.threads
        if fewer:
            threads, thread_override = f"; torch.set_num_threads({proposed})", {"threads": proposed}
        probe = e.thread_probe
        if probe is not None and probe[0] == proposed:  # measured: the model step on fewer threads
            slower = compute * probe[1]  # on `proposed` threads: that many cores busy for that long
            new_step = max(slower, per_batch / k, (per_batch + slower * proposed) / e.cpus)
            change = f"{probe[1]:.2f}x as long" if probe[1] >= 1 else f"{1 / probe[1]:.1f}x faster"
            caveat = (f"; measured: the model step is {change} on {proposed} intra-op thread(s), which leave the "
                      "workers their cores")
        else:
            new_step = max(new_step, (per_batch + compute) / e.cpus)
            caveat = ("; on the CPU the workers share the cores with the model step, so this is an upper bound"
                      + (", reached only with fewer intra-op threads" if fewer else ""))
    gain = (wait + compute) / new_step
    if gain < MIN_GAIN:
        return None  # fewer threads for the model step would cost more than the workers save
    # from the measured wait and compute; on the CPU the model step at fewer threads must be measured too
    measured = e.device != "cpu" or not fewer or (probe is not None and probe[0] == proposed)
    return Recommendation(
        "num_workers", f"Load batches in {k} worker processes (now {k0})",
        f"the loop waits {e.fractions.data_wait:.0%} of each step for loader #{loader.index} ({loader.dataset}, "
        f"num_workers={k0}): {wait * 1e3:.1f} ms of a {e.step_s * 1e3:.1f} ms step; one worker needs "
        f"~{per_batch * 1e3:.1f} ms per batch, so {k} overlap it with the {compute * 1e3:.1f} ms of compute{caveat}",
        f"DataLoader(..., num_workers={k}, persistent_workers=True){threads}  # or trainfast.make_loader(dataset, "
        f"batch_size) / trainfast train --workers auto", gain,
        overrides={"num_workers": k, "persistent_workers": True} | thread_override,
        gain_basis="measured" if measured else "estimate",
        basis_reason=None if measured else f"the model step at {proposed} thread(s) could not be timed; {VERIFY_IT}")


def _overlap_waits(e: Evidence, loader: LoaderStats, wait: float, compute: float) -> Recommendation | None:
    """Batches whose making mostly waits (on storage, a network): as many in flight as the step needs (Little's
    law: in flight = rate x the time a batch takes), beyond the cores, up to where the CPU becomes the limit."""
    workers, k0, step = e.workers, loader.num_workers, wait + compute
    # measured inside the workers where they could time themselves; else, input-bound, k0 workers deliver one batch
    # per step, so each spends k0 steps on one; without workers the main thread makes each batch in the step's wait
    per_batch = workers.batch_s or (k0 * step if k0 else wait)
    cpu_per_batch = workers.busy * per_batch
    if e.device == "cpu":  # the workers' CPU and the model step's (at most its threads busy) share the cores
        floor = (cpu_per_batch + compute * min(e.threads, e.cpus)) / e.cpus
    else:  # one core stays with the process feeding the GPU
        floor = cpu_per_batch / max(1, e.cpus - 1)
    target = max(compute, floor)
    k = min(MAX_WAITING_WORKERS, max(k0 + 1, math.ceil(per_batch / target)))
    new_step = max(target, per_batch / k)
    gain = step / new_step
    if gain < MIN_GAIN:
        return None
    limit = ("the model step" if target == compute else
             f"the CPU: the workers' {cpu_per_batch * 1e3:.1f} ms of CPU per batch and the model step's share the "
             f"{e.cpus} core(s)")
    prefetch = loader.prefetch_factor or 2
    memory = (f" = {format_bytes(k * prefetch * loader.batch_bytes)}" if loader.batch_bytes else "")
    threads = loader.thread_backed
    made = ("timed inside the workers" if workers.batch_s else
            f"so {k0} deliver one every {step * 1e3:.1f} ms" if k0 else "made in the main thread, one at a time")
    capped = (f" (capped at {MAX_WAITING_WORKERS}: trainfast.make_loader's threads hide more latency per process)"
              if k == MAX_WAITING_WORKERS else "")
    what = "threads" if threads else "worker processes"
    fix = (f"trainfast.make_loader(dataset, batch_size, workers={k}, backend='threads')" if threads else
           f"DataLoader(..., num_workers={k}, persistent_workers=True)  # workers that wait need no core each; or "
           "trainfast.make_loader(dataset, batch_size), which raises its concurrency for reads that wait")
    return Recommendation(
        "num_workers", f"Load batches in {k} {what} (now {k0}): the reads wait",
        f"the loop waits {e.fractions.data_wait:.0%} of each step for loader #{loader.index} ({loader.dataset}, "
        f"{k0} {what}), and making a batch mostly waits on reads or other I/O: busy {workers.busy:.0%} of the time "
        f"(measured by {workers.source}). A batch takes ~{per_batch * 1e3:.0f} ms, {made}; by Little's law, a batch "
        f"every {new_step * 1e3:.1f} ms (limited by {limit}) needs ~{per_batch / new_step:.1f} batches in flight: "
        f"{k} {what}{capped}, using ~{k * workers.busy:.1f} core(s) between them; memory in flight: {k} x "
        f"{prefetch} batches{memory}",
        fix, gain, overrides=None if threads else {"num_workers": k, "persistent_workers": True},
        gain_basis="measured" if workers.batch_s else "estimate",
        basis_reason=None if workers.batch_s else ("the time a batch takes inside a worker is derived from the step "
                                                   f"(workers that could not time themselves); {VERIFY_IT}"))


def _workers_contend(e: Evidence) -> bool:
    """The loader's workers take turns on the cores: queued for one a good part of their time, or not measured
    (then assumed, as before the OS was asked)."""
    w = e.workers
    return w is None or (w.queued if w.queued is not None else w.busy) >= QUEUED_CONTEND


def fewer_workers(e: Evidence) -> Recommendation | None:
    """More loader workers than cores to run them: they take turns, and on the CPU they take the model step's."""
    loader = _main_loader(e)
    cap = max(1, e.cpus - 1) if e.device == "cuda" else e.cpus
    if loader is None or loader.num_workers <= cap or not _workers_contend(e):
        return None  # workers that wait (or sit idle) hold no core: there are no turns to take
    return Recommendation(
        "num_workers", f"Load batches in {cap} worker process(es) (now {loader.num_workers})",
        f"loader #{loader.index} runs {loader.num_workers} workers on {e.cpus} usable CPU(s)"
        + (", one of which the process feeding the GPU needs" if e.device == "cuda" else
           ", which the model step's threads share")
        + ": the extra workers only take turns on the same cores (and their memory)",
        f"DataLoader(..., num_workers={cap})  # or trainfast train --workers auto", None,
        overrides={"num_workers": cap}, basis_reason=f"no gain to measure in one run: {VERIFY_IT}")


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
    measured = _measured_faster(e, f"threads:{chosen}") if chosen is not None else None
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


def in_memory(e: Evidence) -> Recommendation | None:
    loader = _main_loader(e)
    if loader is None or not loader.in_memory or loader.kind.startswith("trainfast TensorLoader"):
        return None
    wait = e.fractions.data_wait
    if loader.num_workers == 0 and wait <= DATA_WAIT_BOUND:
        return None
    gain = _speedup_of_part(wait, IN_MEMORY_SPEEDUP) if wait > 0 else None
    reason = f"{IN_MEMORY_SPEEDUP:.0f}x is this project's benchmark, not this loader's; {NEEDS_EDIT}"
    workers = f" with {loader.num_workers} workers (IPC for data already in RAM)" if loader.num_workers else ""
    return Recommendation(
        "in_memory", "Batch in-memory tensors by indexing instead of per-sample collate",
        f"loader #{loader.index} iterates a {loader.dataset} sample by sample{workers}; data wait is {wait:.0%} of "
        f"each step; one index gather per batch is {IN_MEMORY_SPEEDUP:.0f}x faster than __getitem__ + collate "
        "(BENCHMARKS.md)",
        "loader = trainfast.make_loader((inputs, targets), batch_size)  # num_workers=0, batched indexing", gain,
        basis_reason=reason)


def pin_memory(e: Evidence) -> Recommendation | None:
    loader = _main_loader(e)
    if e.device != "cuda" or loader is None or loader.pin_memory or e.fractions.transfer <= 0.02:
        return None
    return Recommendation(
        "pin_memory", "Pin host memory and copy with non_blocking=True",
        f"{e.fractions.transfer:.0%} of each step is spent blocked copying batches to the GPU from pageable memory",
        "DataLoader(..., pin_memory=True) and x.to('cuda', non_blocking=True)  # or trainfast.DevicePrefetcher",
        _speedup_of_part(e.fractions.transfer, 10.0), overrides={"pin_memory": True},
        basis_reason=f"assumed 10x faster copies from pinned memory; {VERIFY_IT}")


def persistent_workers(e: Evidence) -> Recommendation | None:
    loader = _main_loader(e)
    # Only once a second epoch began: a run of one epoch (or one stopped in its first) has no restart to save.
    if (loader is None or loader.num_workers == 0 or loader.persistent_workers or loader.thread_backed
            or len(loader.startup_s) < 2 or loader.epochs < 2):  # (a ThreadLoader has no such setting)
        return None
    startup = sum(loader.startup_s[1:]) / len(loader.startup_s[1:])  # restarts (the first start stays)
    cost = e.epoch_cost
    if cost is not None:  # 2+ epoch starts measured: what their steps took beyond the others is the cost
        periodic = e.periodic if e.periodic is not None and e.periodic.epoch_starts else None
        return _restart_cost(loader, cost, periodic.span if periodic is not None else 1, startup)
    per_epoch = loader.batches_per_epoch
    if per_epoch is None:  # no len(): an epoch is what was seen, once a second one began (an upper bound)
        per_epoch = loader.batches // (loader.epochs - 1)
    epoch_s = per_epoch * e.step_s
    gain = 1 + startup / epoch_s if epoch_s > 0 else None
    if gain is not None and gain < 1.005:
        return None
    return Recommendation(
        "persistent_workers", "Keep the loader's workers alive between epochs",
        f"every epoch restarts {loader.num_workers} workers: {startup:.2f} s from iter() to the first batch"
        + (f", against a {epoch_s:.1f} s epoch" if epoch_s > 0 else ""),
        "DataLoader(..., persistent_workers=True)", gain, overrides={"persistent_workers": True},
        gain_basis="measured")


def _restart_cost(loader: LoaderStats, cost: Any, slow_run: int, startup: float) -> Recommendation | None:
    """persistent_workers from the epoch-start steps' excess (periodic.py `epoch_cost`): the last epoch's shutdown,
    the fork and the wait for the first batch, not iter() to the first batch alone. `slow_run`: the slow steps from
    each epoch start (periodic.py `Periodic.span`); those after the first stay slow with persistent workers. None
    when the epoch starts did not stand out from the other steps: the restart hides within their spread."""
    gain = cost.gain
    if not cost.stands_out or gain is None or gain < 1.005:
        return None
    after = (f"; the {slow_run - 1} step(s) after it, slow too, are not counted: persistent workers fill their "
             "queues beside them as well" if slow_run > 1 else "")
    return Recommendation(
        "persistent_workers", "Keep the loader's workers alive between epochs",
        f"every epoch restarts {loader.num_workers} workers: {cost.phrase()}; that is {cost.excess_s * 1e3:.0f} ms "
        f"beyond the other steps per epoch start, against a {cost.epoch_s:.2f} s epoch of {cost.period} steps "
        f"({len(cost.starts)} epoch starts measured; {startup * 1e3:.0f} ms of it from iter() to the first batch)"
        f"{after}",
        "DataLoader(..., persistent_workers=True)", gain, overrides={"persistent_workers": True},
        gain_basis="measured")


def prefetch_factor(e: Evidence) -> Recommendation | None:
    loader = _main_loader(e)
    if (loader is None or loader.num_workers == 0 or e.fractions.data_wait <= DATA_WAIT_BOUND
            or e.wait_spike_ratio is None or e.wait_spike_ratio < 3):
        return None
    current = loader.prefetch_factor or 2
    return Recommendation(
        "prefetch_factor", f"Queue more batches per worker (prefetch_factor={current * 2})",
        f"data wait comes in spikes (95th percentile {e.wait_spike_ratio:.1f}x the median step's): a deeper queue "
        f"absorbs slow batches; now {loader.num_workers} workers x {current} batches in flight",
        f"DataLoader(..., prefetch_factor={current * 2})", None, overrides={"prefetch_factor": current * 2},
        basis_reason=f"how much of the spikes a deeper queue absorbs depends on their timing; {VERIFY_IT}")


def _measured_faster(e: Evidence, key: str) -> tuple[Any, float] | None:
    """The replay's trial of `key` and the step's gain from it, where it measured faster by at least MIN_GAIN."""
    trial = e.trials.get(key) if e.trials is not None else None
    gain = trial.gain(e.fractions.compute, e.compute_s) if trial is not None and trial.faster else None
    return (trial, gain) if gain is not None and gain >= MIN_GAIN else None


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
        _speedup_of_part(e.fractions.compute, speedup), basis_reason=f"not measured: {reason}; {NEEDS_EDIT}")


def fp32(e: Evidence) -> Recommendation | None:
    """The script's own autocast, measured slower than float32 (a CPU that emulates bf16: 4.5-5.5x on a public
    image-classification script): the fix reverses its choice, ranked by its measured gain like any other."""
    measured = _measured_faster(e, "fp32")
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


def precision_may_pay(e: Evidence) -> bool:
    """Whether another precision is worth a hint: not where the run autocasts already (its own precision was
    measured against float32: `fp32`) or where mixed precision was measured no faster or cannot apply."""
    trial = e.trials.get("amp") if e.trials is not None else None
    return not e.autocast and not (trial is not None and (not trial.applies or (trial.measured and not trial.faster)))


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
        _speedup_of_part(e.fractions.compute, COMPILE_COMPUTE_SPEEDUP),
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
        _speedup_of_part(e.fractions.compute, factor), basis_reason=f"not measured: {reason}; {NEEDS_EDIT}")


def contiguous(e: Evidence) -> Recommendation | None:
    """The script's channels_last, measured slower than NCHW (oneDNN and cuDNN lack fast NHWC kernels for some
    shapes): the fix reverses its choice, ranked by its measured gain like any other."""
    measured = _measured_faster(e, "contiguous")
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
    gain = _speedup_of_part(e.fractions.host, 4.0) if e.fractions.host > 0 else None
    return Recommendation(
        "host_sync", "Read metrics from the device every N steps, not every step", why,
        "running += loss.detach()  # and every 50 steps: print(running.item() / 50); running.zero_()", gain,
        basis_reason=f"assumed 4x less host time without the syncs; {NEEDS_EDIT}")


def shm_size(e: Evidence) -> Recommendation | None:
    loader = _main_loader(e)
    if loader is None or loader.num_workers == 0 or e.shm_bytes is None or not loader.batch_bytes:
        return None
    need = loader.num_workers * (loader.prefetch_factor or 2) * loader.batch_bytes * SHM_MARGIN
    if e.shm_bytes >= need:
        return None
    return Recommendation(
        "shm_size", "Give /dev/shm more room",
        f"{loader.num_workers} workers x prefetch {loader.prefetch_factor or 2} x {format_bytes(loader.batch_bytes)} "
        f"batches need ~{format_bytes(need)} of shared memory with margin; /dev/shm has {format_bytes(e.shm_bytes)} "
        "free (a full /dev/shm kills workers with a bus error)",
        "docker run --shm-size=8g ...  (or --ipc=host); or fewer workers / a lower prefetch_factor", None,
        basis_reason="a fix against a crash, not for speed")


def decode_size(e: Evidence) -> Recommendation | None:
    loader = _main_loader(e)
    if loader is None or e.fractions.data_wait <= DATA_WAIT_BOUND:
        return None
    pixels = loader.image_hw[0] * loader.image_hw[1] if loader.image_hw else None
    full_decode = loader.decode == "full"
    oversized = pixels is not None and e.jpeg_decoded_pixels is not None and e.jpeg_decoded_pixels >= 4 * pixels
    if not (full_decode or oversized):
        return None
    evidence = (f"JPEGs are decoded at ~{e.jpeg_decoded_pixels:,.0f} pixels for {pixels:,}-pixel inputs"
                if oversized else "the dataset decodes every JPEG at full size")
    return Recommendation(
        "decode_size", "Decode JPEGs at the size you train at",
        f"{evidence}; libjpeg can decode at 1/2, 1/4 or 1/8 scale inside the DCT (Pillow's Image.draft) and the "
        f"resize then starts from a smaller image: {DRAFT_DECODE_SAVING:.0%} less loader work on the demo images. "
        "Packing the dataset once stores them pre-sized (smaller JPEGs) in a few large shards: one file opened per "
        "shard, not per image",
        "img.draft('RGB', (w, h)) before img.convert('RGB')  # or trainfast.ImageFolder(root, image_size=...); or "
        "pre-size once: trainfast pack SRC DST --image-size N, then trainfast train --data DST "
        "(trainfast.PackedImages(DST / 'train', image_size=N) in Python)",
        _speedup_of_part(e.fractions.data_wait, 1 / (1 - DRAFT_DECODE_SAVING)),
        basis_reason=f"the saving is this project's benchmark's, not this dataset's; {NEEDS_EDIT}")


# Worker memory growing faster than this while measuring is not a cache warming up.
COPY_ON_READ_BYTES_PER_MIN = 100 * MIB


def copy_on_read(e: Evidence) -> Recommendation | None:
    loader = _main_loader(e)
    growth = e.worker_private_growth_per_min
    if loader is None or loader.num_workers == 0 or growth is None or growth < COPY_ON_READ_BYTES_PER_MIN:
        return None
    return Recommendation(
        "copy_on_read", "Keep the dataset's per-sample lists in numpy arrays, not Python lists",
        f"the {loader.num_workers} loader workers' private memory grew by {format_bytes(growth)} per minute while "
        "measuring: reading a Python list of objects touches their refcounts, so each worker gradually copies the "
        "parent's pages (pytorch#13246); long runs end in an out-of-memory kill",
        "self.paths = np.array(paths, dtype=bytes)  # or one bytes buffer + offsets; as trainfast.ImageFolder does",
        None, basis_reason="a fix against running out of memory, not for speed")


def batch_size(e: Evidence) -> Recommendation | None:
    if e.fractions.host <= HOST_BOUND or (e.gpu_memory_fraction is not None and e.gpu_memory_fraction > 0.5):
        return None
    memory = f"; peak GPU memory is {e.gpu_memory_fraction:.0%} of the card" if e.gpu_memory_fraction else ""
    return Recommendation(
        "batch_size", "Use a larger batch to amortise per-step overhead",
        f"{e.fractions.host:.0%} of each step is fixed per-step host work{memory}; doubling the batch halves it per "
        "sample (scale the learning rate with it)",
        "DataLoader(..., batch_size=2 * batch_size)  # and lr *= 2 (linear scaling) or sqrt(2)",
        _speedup_of_part(e.fractions.host, 2.0),
        basis_reason=f"assumed the host work stays per step as the batch doubles; {NEEDS_EDIT}")


# Exposed communication a fix to the wrapper's settings is assumed to remove: half (bucket views and larger
# buckets, FSDP2's prefetching or keeping the parameters gathered between forward and backward, fewer syncs): an
# assumption, not a measurement, as no replay can time a collective without the job's other ranks.
COMM_HIDDEN = 2.0


def communication(e: Evidence) -> Recommendation | None:
    """The step waits in collectives (exposed communication, comms.py) for more than DATA_WAIT_BOUND of it: the
    wrapper's settings that overlap or shrink it. Amdahl on the measured share, the factor assumed (COMM_HIDDEN)."""
    share = e.fractions.communication
    if share <= DATA_WAIT_BOUND or not e.collectives:
        return None
    wrappers = set(e.collectives.get("wrappers") or ())
    kinds = list(e.collectives.get("kinds") or {})
    why = (f"{share:.0%} of each step is spent blocked in {', '.join(kinds) or 'collectives'} (exposed: not "
           "overlapped with compute); part of it may be the wait for a slower rank to join, which these settings do "
           "not remove (the job's report names a rank the others wait for)")
    reason = f"assumed {COMM_HIDDEN:g}x less exposed communication; {NEEDS_EDIT}, and no replay can time a collective"
    gain = _speedup_of_part(share, COMM_HIDDEN)
    if "ddp" in wrappers:
        view = "" if e.collectives.get("ddp_gradient_as_bucket_view") else "gradient_as_bucket_view=True, "
        return Recommendation(
            "ddp_communication", "Overlap DDP's all-reduce with backward, or sync less often",
            why + ("; DDP copies the reduced gradients out of its buckets after waiting for them, which bucket views "
                   "avoid" if view else ""),
            f"DistributedDataParallel(model, {view}bucket_cap_mb=50)  # or accumulate: with model.no_sync(): "
            "for all but the last micro-batch", gain, basis_reason=reason)
    if wrappers & {"fsdp2", "fsdp"}:
        return Recommendation(
            "fsdp_communication", "Prefetch FSDP's all-gathers, or keep parameters gathered for backward",
            why + "; FSDP all-gathers each block's parameters before its forward (and again before its backward "
            "when it resharded after forward) and reduce-scatters its gradients",
            "fully_shard(block, reshard_after_forward=False)  # no all-gather in backward, more memory; or "
            "block.set_modules_to_forward_prefetch([next_block])", gain, basis_reason=reason)
    return Recommendation(
        "fewer_collectives", "Issue the script's collectives less often",
        why + "; they are the script's own (no DDP or FSDP wrapper issued them)",
        "dist.all_reduce(metric, async_op=True)  # and wait later, or reduce metrics every N steps", gain,
        basis_reason=reason)


RULES: tuple[Callable[[Evidence], Recommendation | None], ...] = (
    num_workers, fewer_workers, cpu_threads, threads, in_memory, pin_memory, persistent_workers, prefetch_factor, amp,
    fp32, bf16, compile_model, channels_last, contiguous, cudnn_benchmark, host_sync, shm_size, decode_size,
    copy_on_read, batch_size, communication)


def recommend(e: Evidence) -> list[Recommendation]:
    """Every rule that applies: the measured gains first, then the estimates (an estimate never outranks a
    measurement), each largest first; fixes with no figure come last."""
    found = [r for rule in RULES if (r := rule(e)) is not None]
    return sorted(found, key=lambda r: (r.gain_basis == "estimate", -(r.expected_gain or 0.0)))


def not_offered(e: Evidence) -> list[str]:
    """Notes for the candidates the replay measured and found no faster (the measurement that kept them out), the
    ones the doctor could not time (its own step that failed), and a replay done in place or not at all."""
    if e.trials is None:
        return []
    notes = [f"no candidate fix was timed on the model: {e.trials.reason}"] if e.trials.reason else []
    if e.trials.in_place:
        notes.append(f"{e.trials.model} could not be copied, so the candidates were timed on the model itself, its "
                     "gradients, buffers and layout put back after each")
    for key, trial in e.trials.trials.items():
        what = {"amp": "mixed precision", "fp32": "float32", "channels_last": "channels_last",
                "contiguous": "NCHW"}.get(key, trial.setting)
        if trial.failed:
            notes.append(f"{what} not measured: {trial.reason} (each candidate is timed on its own: this failure "
                         "stopped no other)")
        elif trial.measured and not trial.faster:
            notes.append(f"{what} not recommended: the model's forward and backward under {trial.setting} ran "
                         f"{trial.factor:.2f}x as fast as the script's ({trial.spread()}, measured on its own "
                         f"input; a fix must be {MARGIN:.2f}x or more in most rounds)")
    return notes


# The fixes that act on the input side: an input-bound verdict with none of them says why
INPUT_FIXES = frozenset({"num_workers", "in_memory", "pin_memory", "persistent_workers", "prefetch_factor",
                         "shm_size", "decode_size", "copy_on_read"})


def why_no_input_fix(e: Evidence, recommendations: Sequence[Recommendation]) -> str | None:
    """For an input-bound step that no input-side fix addresses: what stands in the way, and what is left."""
    if e.verdict != "input-bound" or INPUT_FIXES & {r.id for r in recommendations}:
        return None
    cheaper = ("make each batch cheaper to produce (decode at the size trained: Pillow's draft() or `trainfast "
               "pack`; pre-process once instead of every epoch; augment on the device)")
    loader = _main_loader(e)
    if loader is None:
        return (f"no input-side fix to propose: no DataLoader fed training, so the loop prepares its batches itself "
                f"between steps; move that work into a DataLoader with workers, or {cheaper}")
    if loader.num_workers >= e.cpus - (e.device == "cuda") and not (e.workers is not None and e.workers.wait):
        return (f"no input-side fix to propose: loader #{loader.index} already runs {loader.num_workers} worker(s) "
                f"on {e.cpus} usable CPU(s), so more workers would only share the same cores; {cheaper}")
    return f"no input-side fix to propose from what was measured; {cheaper}"
