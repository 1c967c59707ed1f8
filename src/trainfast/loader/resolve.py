"""The resolve step of `make_loader`: (dataset, batch size, `LoaderOptions`) and this process's environment ->
a `LoaderResolution`, the plan and all `build_loader` needs. Nothing is built and no worker starts."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch.utils.data import Dataset, TensorDataset

from trainfast.device import device_kind
from trainfast.envcheck.environment import tensors_batch_bytes
from trainfast.host import available_cpus, memory
from trainfast.launch import launch_env
from trainfast.loader import faults
from trainfast.loader.auto import LoaderPlan, auto_prefetch, plan_loader, worker_cores
from trainfast.loader.faults import fit_shared_memory
from trainfast.loader.latency import probe_reads, size_pool
from trainfast.loader.options import LoaderOptions, check_choice, is_int
from trainfast.loader.prefetch import Normalize
from trainfast.loader.tuned import WorkerSettings, for_share
from trainfast.loader.tuned import load as tuned_config

log = logging.getLogger("trainfast")


@dataclass(frozen=True)
class LoaderResolution:
    """What `resolve_loader` decided, and everything `build_loader` needs to build the loader from it.

    `plan`: every "auto" resolved, with its reasons. `tensors`: the in-memory tensors when they are batched in
    place by indexing (`TensorLoader`, no workers), else None and a DataLoader indexes `samples` (tensors given
    as a sequence are wrapped in a `TensorDataset` for it). `length`: samples per epoch before sharding.
    `rank`, `world_size`, `cpus` (usable CPUs of this process) and `normalize` are the values resolved.
    """

    options: LoaderOptions
    batch_size: int
    plan: LoaderPlan
    samples: Dataset[Any]
    tensors: tuple[torch.Tensor, ...] | None
    length: int
    rank: int
    world_size: int
    cpus: int
    normalize: Normalize | None


def check_batch_size(batch_size: Any) -> None:
    check_choice("batch_size", batch_size, is_int(batch_size, 1), "a positive integer")


def resolve_loader(dataset: Dataset[Any] | Sequence[torch.Tensor], batch_size: int,
                   options: LoaderOptions | None = None) -> LoaderResolution:
    """Every "auto" of `options` resolved for `dataset` on this machine; builds no DataLoader, starts no worker.

    Reads from the environment: the launch (`launch_env`): `RANK` and `WORLD_SIZE` (torchrun's; 0 and 1 without
    them) where `options` leaves rank/world_size None, `LOCAL_WORLD_SIZE` (processes sharing this machine's CPUs);
    the CPUs this process may use; with `device="auto"`, whether CUDA is available; with `workers="tuned"`,
    `trainfast tune`'s result in the cache (its workers and threads scaled to this process's share of the CPUs);
    with `workers="auto"` and `backend` "auto" or "threads", a few of the dataset's reads, timed (`probe_reads`,
    about a second at most whatever a read does);
    with workers, the free space of /dev/shm (prefetch_factor is lowered to fit, and a `LoaderError` is raised if
    even 1 cannot).
    Invalid input raises ValueError or TypeError, as `make_loader` (a malformed launch variable: ValueError too).
    """
    check_batch_size(batch_size)
    options = options if options is not None else LoaderOptions()
    target = _target_type(options.device)
    launch = launch_env()
    rank = launch.rank if options.rank is None else options.rank
    world_size = launch.world_size if options.world_size is None else options.world_size
    # torchrun starts one process per device; they share this machine's CPUs.
    local_procs = launch.local_world_size
    machine_cpus = available_cpus()
    cpus = launch.cpus_per_process(machine_cpus)

    tensors = _in_memory_tensors(dataset)
    if tensors is None and not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise TypeError(f"make_loader needs a map-style dataset (with __getitem__ and __len__) or tensors; "
                        f"got {type(dataset).__name__}")
    n = tensors[0].shape[0] if tensors is not None else len(dataset)  # type: ignore[arg-type]
    plan = _plan(dataset, batch_size, options, tensors, n, target, cpus, machine_cpus=machine_cpus,
                 local_procs=local_procs)
    norm = options.normalize if options.normalize is not None else getattr(dataset, "normalize", None)
    samples = cast(Dataset[Any], dataset)  # any sequence of samples works, as with DataLoader
    in_place = tensors is not None and plan.num_workers == 0
    threads = (options.backend == "threads" or plan.backend == "threads") and plan.num_workers > 0
    if threads:
        plan = _for_threads(plan)
        if tensors is not None and not isinstance(samples, Dataset):
            samples = TensorDataset(*tensors)
    else:
        plan = replace(plan, backend="processes")  # a tuning's "threads" with no workers: nothing to thread
        if not in_place:
            plan, samples = _for_dataloader(plan, samples, tensors, batch_size, options.timeout_s)
    if options.backend == "threads" and not threads:
        plan = replace(plan, reasons=(*plan.reasons, "backend='threads' ignored: no workers, batches are loaded "
                                      "in the main thread"))
    return LoaderResolution(options=options, batch_size=batch_size, plan=plan, samples=samples,
                            tensors=tensors if in_place else None, length=n, rank=rank, world_size=world_size,
                            cpus=cpus, normalize=norm)


def _for_dataloader(plan: LoaderPlan, samples: Dataset[Any], tensors: tuple[torch.Tensor, ...] | None,
                    batch_size: int, timeout_s: float) -> tuple[LoaderPlan, Dataset[Any]]:
    """The plan and the dataset for a DataLoader: tensors on a device refused for workers, tensors given as a
    sequence wrapped in a `TensorDataset`, prefetch fitted to /dev/shm (workers) or an unused timeout noted."""
    on_device = sorted({str(t.device) for t in tensors or () if t.device.type != "cpu"})
    if on_device:  # worker processes cannot index a GPU's memory (CUDA does not survive fork)
        raise ValueError(f"workers={plan.num_workers} with tensors on {', '.join(on_device)}: worker processes "
                         "cannot index device memory; use workers=0 (or 'auto'), which batches them in place")
    if tensors is not None and not isinstance(samples, Dataset):
        samples = TensorDataset(*tensors)
    if plan.num_workers > 0:  # before any worker starts: batches pass through /dev/shm
        plan = _fit_shared_memory(plan, tensors, samples, batch_size)
    elif timeout_s:
        plan = replace(plan, reasons=(*plan.reasons, f"timeout_s={timeout_s:g} ignored: it bounds the wait for "
                                      "worker processes and there are none"))
    return plan, samples


def _for_threads(plan: LoaderPlan) -> LoaderPlan:
    """The plan for loader threads: no processes, so nothing persists between epochs and /dev/shm is not used."""
    n, pf = plan.num_workers, plan.prefetch_factor or 2
    reasons = tuple(r for r in plan.reasons if not r.startswith("persistent_workers="))
    most = plan.most_threads or n
    return replace(plan, backend="threads", persistent_workers=False, reasons=(
        *reasons, f"backend=threads: {n} loader thread(s) in this process, each making whole batches (no IPC; "
        f"at most {most * pf} batches in flight, the next epoch's first ones made during this one's last)"))


def _plan(dataset: Any, batch_size: int, options: LoaderOptions, tensors: tuple[torch.Tensor, ...] | None,
          n: int, target: str, cpus: int, *, machine_cpus: int, local_procs: int) -> LoaderPlan:
    """`plan_loader` for these options, with `trainfast tune`'s result in place of "auto" for `workers="tuned"`:
    scaled to this process's `cpus` when `local_procs` processes share the machine's `machine_cpus`."""
    workers, prefetch_factor, pin_memory = options.workers, options.prefetch_factor, options.pin_memory
    measured = _tuned_settings(dataset, batch_size, target) if workers == "tuned" else None
    tuned, shared = measured, None
    if measured is not None:
        tuned = for_share(measured, machine_cpus=machine_cpus, share_cpus=cpus)
        if tuned != measured:
            shared = _share_reason(measured, tuned, machine_cpus=machine_cpus, cpus=cpus, local_procs=local_procs)
            log.info("make_loader: %s", shared)
    if tuned is not None:
        workers, prefetch_factor, pin_memory = tuned.num_workers, tuned.prefetch_factor or "auto", tuned.pin_memory
    plan = plan_loader(workers="auto" if workers == "tuned" else workers, pin_memory=pin_memory,
                       prefetch_factor=prefetch_factor, persistent_workers=options.persistent_workers,
                       drop_last=options.drop_last, shuffle=options.shuffle, dataset_len=n,
                       in_memory=tensors is not None, target=target, cpus=cpus,
                       on_device=tensors is not None and all(t.device.type != "cpu" for t in tensors))
    if tuned is not None and measured is not None:  # the tuning's backend too ("threads" kept when asked for)
        plan = replace(plan, cpu_threads=tuned.cpu_threads, backend=tuned.backend,
                       reasons=(f"tuned by measurement ({measured.label()})", *((shared,) if shared else ()),
                                *plan.reasons))
    elif workers in ("auto", "tuned") and options.backend != "processes" and tensors is None:
        plan = _for_reads(plan, dataset, n, batch_size, options, worker_cores(cpus, target))
    return plan


def _for_reads(plan: LoaderPlan, dataset: Any, n: int, batch_size: int, options: LoaderOptions,
               cores: int) -> LoaderPlan:
    """`plan` for this dataset's reads, a few of them timed (`probe_reads`: ~1 s at most, a read still running then
    counted up to it): reads that wait (network storage) get loader threads sized to hide their latency within the
    loader's `cores` (`size_pool`); reads that use the CPU, or that could not be timed, keep `plan` as it is, with
    the reason when `backend="auto"` chose processes."""
    probe = probe_reads(dataset, n)
    if probe is not None and probe.cut_off is not None:  # a storage stall, worth knowing about
        log.info("make_loader: a read (sample %d) was still running after %.1f s; its time until then counts, the "
                 "plan goes on without it",
                 probe.cut_off.index, probe.cut_off.wall_s)
    if probe is None or not probe.waiting:
        if options.backend != "auto" or plan.num_workers == 0:
            return plan
        why = f"reads use the CPU ({probe.describe()})" if probe else "the reads could not be timed (one failed)"
        return replace(plan, reasons=(*plan.reasons, f"backend=processes: {why}: worker processes, sized by the "
                                      "cores"))
    # 2 a thread: the head batch in order may be slow while the others wait done (waiting reads: >= 2 threads)
    pf = auto_prefetch(2) if options.prefetch_factor == "auto" else options.prefetch_factor
    pool = size_pool(probe, batch_size=batch_size, cores=cores, prefetch_factor=pf, available_bytes=memory().available)
    kept = tuple(r for r in plan.reasons if not r.startswith(("num_workers=", "prefetch_factor=",
                                                                 "persistent_workers=")))
    return replace(plan, num_workers=pool.threads, prefetch_factor=pf, backend="threads", loader_cores=cores,
                   most_threads=pool.most, reasons=(pool.reasons[0], *kept, *pool.reasons[1:]))


def _share_reason(measured: WorkerSettings, scaled: WorkerSettings, *, machine_cpus: int, cpus: int,
                  local_procs: int) -> str:
    """Why a tuning's workers and threads were cut: each of torchrun's local processes would otherwise start all
    of them (8 ranks x 14 tuned workers = 112 processes on 16 cores)."""
    changes = [f"workers {measured.num_workers} -> {scaled.num_workers}"]
    if measured.cpu_threads is not None and scaled.cpu_threads is not None:
        changes.append(f"cpu_threads {measured.cpu_threads} -> {scaled.cpu_threads}")
    return (f"workers='tuned' scaled to this process's share: LOCAL_WORLD_SIZE={local_procs} processes share "
            f"{machine_cpus} CPUs ({cpus} each) and the tuning measured one process with all {machine_cpus}: "
            + ", ".join(changes))


def _fit_shared_memory(plan: LoaderPlan, tensors: tuple[torch.Tensor, ...] | None, dataset: Any,
                       batch_size: int) -> LoaderPlan:
    """`faults.fit_shared_memory` with the free /dev/shm read now and the batch size estimated where it can be:
    tensors from their shapes, a dataset that declares `sample_bytes` (as `ImageFolder`) from that."""
    if tensors is not None:
        batch_bytes = tensors_batch_bytes(tensors, batch_size)
    else:
        try:
            per_sample = getattr(dataset, "sample_bytes", None)
        except Exception:  # a dataset's __getattr__ may do anything: the estimate is optional
            per_sample = None
        batch_bytes = batch_size * per_sample if isinstance(per_sample, int) and is_int(per_sample, 1) else None
    plan, warning = fit_shared_memory(plan, faults.read_shm_bytes(), batch_bytes)
    if warning:
        log.warning("make_loader: %s", warning)
    return plan


def _tuned_settings(dataset: Any, batch_size: int, target: str) -> WorkerSettings | None:
    """The configuration `trainfast tune` chose for this dataset and batch size on this machine, if any."""
    chosen = tuned_config(dataset, batch_size, device=target)
    if chosen is None:
        log.info("make_loader: workers='tuned' but no tuning result for this dataset and batch size on this "
                 "machine (run `trainfast tune`); using 'auto'")
    return chosen


def _target_type(device: str | torch.device) -> str:
    if isinstance(device, torch.device):
        return device.type
    kind = device_kind(device)
    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return kind


def _in_memory_tensors(dataset: Any) -> tuple[torch.Tensor, ...] | None:
    if isinstance(dataset, TensorDataset):
        return tuple(dataset.tensors)
    if isinstance(dataset, (tuple, list)) and dataset and all(isinstance(t, torch.Tensor) for t in dataset):
        return tuple(dataset)
    return None
