"""The one place where the loader's "auto" settings are resolved: pure functions, each choice with its reason."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Auto = Literal["auto"]

# Below this many samples an epoch is over before workers pay for their start-up (measured here:
# ~60 ms per forked worker; the demo's JPEGs cost ~1 ms each, so 512 samples is ~0.5 s of work).
TINY_DATASET = 512
# Most workers "auto" starts per device: past this, the IPC and memory cost outgrow the gain on
# typical image pipelines, and users with more decode work can say so explicitly.
MAX_AUTO_WORKERS = 16
# Batches to keep in flight across all workers so one slow batch does not starve the device.
IN_FLIGHT_BATCHES = 4


@dataclass(frozen=True)
class LoaderPlan:
    """What `make_loader` chose, and why (one reason per setting)."""

    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None
    drop_last: bool
    in_memory: bool
    reasons: tuple[str, ...]
    cpu_threads: int | None = None  # intra-op threads a tuning measured best beside these workers (CPU training)
    backend: str = "processes"  # what the workers are: "processes" or "threads"
    # Reads that wait (latency.py): the cores the loader threads may keep busy, fewer than the threads, and the
    # most threads the pool grows to (None: a fixed pool, as many workers as cores)
    loader_cores: int | None = None
    most_threads: int | None = None

    def describe(self) -> str:
        return "; ".join(self.reasons)


def split_cpu(cpus: int) -> tuple[int, int]:
    """(loader workers, intra-op threads) for training *on the CPU*, where both share the same cores.

    Half the cores each. Measured on the demo (2 CPUs, ConvNet at 64 px, channels_last): 1 thread + 1
    worker 754 samples/s, 1 + 2: 773, 2 + 1: 608, 2 + 2: 593, 2 threads and no worker: 584. A second
    intra-op thread helps only when it does not compete with the workers for the same core.
    """
    workers = min(MAX_AUTO_WORKERS, max(1, cpus // 2))
    return workers, threads_beside_workers(cpus, workers)


def worker_cores(cpus: int, target: str, devices: int = 1) -> int:
    """The cores "auto" gives the loader's workers: on CUDA all but one per device's main process, on the CPU
    `split_cpu`'s share (the rest run the compute), at most `MAX_AUTO_WORKERS`."""
    if target == "cuda":
        return min(MAX_AUTO_WORKERS, max(1, cpus // max(1, devices) - 1))
    return split_cpu(cpus)[0]


def auto_prefetch(workers: int) -> int:
    """Batches each of `workers` workers loads ahead: `IN_FLIGHT_BATCHES` in all, at least 2 each."""
    return max(2, math.ceil(IN_FLIGHT_BATCHES / workers))


def batches_in_flight(num_workers: int, prefetch_factor: int | None) -> int:
    """The batches a DataLoader's workers hold loaded ahead: `num_workers` x `prefetch_factor` (torch's default 2).
    A measurement that starts before they drain times the queue, not the workers' rate."""
    return num_workers * (2 if prefetch_factor is None else prefetch_factor)


def threads_beside_workers(cpus: int, workers: int) -> int:
    """Intra-op threads for CPU training next to `workers` loader processes."""
    return max(1, cpus - workers)


def plan_loader(*, workers: int | Auto, pin_memory: bool | Auto, prefetch_factor: int | Auto,
                persistent_workers: bool | Auto, drop_last: bool | Auto, shuffle: bool, dataset_len: int,
                in_memory: bool, target: str, cpus: int, devices: int = 1, on_device: bool = False) -> LoaderPlan:
    """Resolve every "auto" for a loader feeding `target` ("cpu" or "cuda") from `cpus` usable CPUs.

    `on_device`: the data is in-memory tensors that all live on an accelerator already (nothing to copy).
    `devices`: the devices `cpus` is shared among. `resolve_loader` passes this process's share already
    (`LaunchEnv.cpus_per_process`: one device per process under torchrun), hence the default 1; a caller with the
    whole machine's CPUs and several devices fed from one process passes their number. No environment is read here.
    """
    reasons: list[str] = []
    if workers != "auto":
        n = workers
        reasons.append(f"num_workers={n} (given)")
    elif in_memory:
        n = 0
        reasons.append("num_workers=0: tensors already in memory are batched by indexing, workers would only add IPC")
    elif dataset_len < TINY_DATASET:
        n = 0
        reasons.append(f"num_workers=0: {dataset_len} samples (< {TINY_DATASET}) load faster than workers start")
    elif target == "cuda":
        n = worker_cores(cpus, target, devices)
        reasons.append(f"num_workers={n}: {cpus} usable CPUs / {devices} device(s), "
                       "one core kept per device's main process")
    else:
        n = worker_cores(cpus, target)
        threads = threads_beside_workers(cpus, n)
        reasons.append(f"num_workers={n}: {cpus} usable CPUs shared with {threads} compute thread(s) on the CPU")

    if on_device:
        # Pinning page-locks host memory; these tensors are not in host memory, and pinning them is an error.
        # An explicit True is ignored rather than rejected: `workers="tuned"` passes on a tuning's choice.
        pin = False
        reasons.append("pin_memory=True ignored: the tensors are already on the device and only host memory can "
                       "be pinned" if pin_memory is True else
                       "pin_memory=False (tensors already on the device: no host-to-device copy to speed up)")
    else:
        pin = (target == "cuda") if pin_memory == "auto" else pin_memory
        reasons.append(f"pin_memory={pin}" + (" (target is CUDA: page-locked buffers copy asynchronously)"
                                               if pin_memory == "auto" and pin else ""))
    persistent = n > 0 if persistent_workers == "auto" else (persistent_workers and n > 0)
    if n > 0:
        reasons.append(f"persistent_workers={persistent}" + (" (no worker restart each epoch)" if persistent else ""))
        pf = auto_prefetch(n) if prefetch_factor == "auto" else prefetch_factor
        reasons.append(f"prefetch_factor={pf} ({n * pf} batches in flight)")
    else:
        pf = None
        ignored = [f"{name}={value}" for name, value in (("persistent_workers", persistent_workers),
                                                          ("prefetch_factor", prefetch_factor))
                   if value not in ("auto", False, None)]
        if ignored:
            reasons.append(f"{' and '.join(ignored)} ignored: they apply to worker processes and there are none")
    drop = shuffle if drop_last == "auto" else drop_last
    why = " (training: equal batch shapes every step)" if drop_last == "auto" and drop else ""
    reasons.append(f"drop_last={drop}{why}")
    return LoaderPlan(num_workers=n, pin_memory=pin, persistent_workers=persistent, prefetch_factor=pf,
                      drop_last=drop, in_memory=in_memory, reasons=tuple(reasons))


def training_threads(plan: LoaderPlan | None, workers: int, cpus: int, shared: bool) -> tuple[int, str]:
    """Intra-op threads for training on the CPU fed by a loader with `workers` workers, on `cpus` usable CPUs of
    this process (`shared`: other ranks share the machine), and the reason: a tuning's measured best when the loader
    carries one, else the cores its workers leave (threads that mostly wait on reads: the plan's `loader_cores`)."""
    if plan is not None and plan.cpu_threads is not None:
        scaled = ", scaled to this process's share of the CPUs" if shared else ""
        return plan.cpu_threads, (f"cpu_threads={plan.cpu_threads} beside {plan.num_workers} worker(s): trainfast "
                                  f"tune's measured best{scaled}")
    if plan is not None and plan.loader_cores is not None:
        chosen = threads_beside_workers(cpus, plan.loader_cores)
        return chosen, (f"cpu_threads={chosen}: {cpus} usable CPUs shared with {workers} loader thread(s) whose reads "
                        f"mostly wait, kept within {plan.loader_cores} core(s)")
    chosen = threads_beside_workers(cpus, workers)
    return chosen, f"cpu_threads={chosen}: {cpus} usable CPUs shared with {workers} loader worker(s)"
