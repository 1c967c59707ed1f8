"""The input pipeline's fixes: rules from the evidence to recommendations for the loader (workers, threads beside
them, pinned memory, persistent workers, prefetch depth, shared memory, decoding, copy-on-read), and why an
input-bound step gets none. The gain's basis: recommendation.py."""

from __future__ import annotations

import math
from typing import Any

from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.fixes.rule import MIN_GAIN, NEEDS_EDIT, VERIFY_IT, speedup_of_part
from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.records.steps import LoaderStats, main_loader
from trainfast.diagnose.verdict import DATA_WAIT_BOUND, REPLAY_POSSIBLE
from trainfast.units import MIB, format_bytes

# The in-memory path batches by index gathers: 10.7x the batches/s of DataLoader(TensorDataset) here.
IN_MEMORY_SPEEDUP = 10.0


# Draft JPEG decode + uint8: 0.90 vs 1.63 ms per image on the demo images (BENCHMARKS.md): 45 % less work.
DRAFT_DECODE_SAVING = 0.45


# /dev/shm holds each worker's prefetched batches and the one being written.
SHM_MARGIN = 2


# Most worker processes proposed for workers that wait: each forked worker costs ~60 ms to start and its own
# interpreter's memory; past this, threads in one process (trainfast.make_loader) hide the latency more cheaply.
MAX_WAITING_WORKERS = 64


# Workers queued for a core this share of their time take turns on the cores: fewer of them is worth saying.
QUEUED_CONTEND = 0.2


# Worker memory growing faster than this while measuring is not a cache warming up.
COPY_ON_READ_BYTES_PER_MIN = 100 * MIB


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


def in_memory(e: Evidence) -> Recommendation | None:
    loader = _main_loader(e)
    if loader is None or not loader.in_memory or loader.kind.startswith("trainfast TensorLoader"):
        return None
    wait = e.fractions.data_wait
    if loader.num_workers == 0 and wait <= DATA_WAIT_BOUND:
        return None
    gain = speedup_of_part(wait, IN_MEMORY_SPEEDUP) if wait > 0 else None
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
        speedup_of_part(e.fractions.transfer, 10.0), overrides={"pin_memory": True},
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
        speedup_of_part(e.fractions.data_wait, 1 / (1 - DRAFT_DECODE_SAVING)),
        basis_reason=f"the saving is this project's benchmark's, not this dataset's; {NEEDS_EDIT}")


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
