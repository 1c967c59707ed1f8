"""The input pipeline's fixes (the loader's workers: workers.py): in-memory batching, pinned memory, persistent
workers, the prefetch depth, shared memory, decoding at the training size, copy-on-read. The gain's basis:
records/findings.py. A fix that adds worker processes, or keeps them between epochs, where the loop sets attributes on
the dataset after its loader started (capture/dataset_watch.py) says its workers would never see them
(workers.py `unseen_by_workers`): it is known to train a different model (`Recommendation.changes_training`)."""

from __future__ import annotations

from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.evidence.periodic import Periodic
from trainfast.diagnose.evidence.wholerun import RunEvidence
from trainfast.diagnose.fixes.rule import NEEDS_EDIT, VERIFY_IT, Rule, register, speedup_of_part
from trainfast.diagnose.fixes.workers import warned
from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.records.steps import LoaderStats, main_loader
from trainfast.diagnose.verdict import DATA_WAIT_BOUND
from trainfast.envcheck.checks import shm_needed_bytes
from trainfast.units import MIB, format_bytes

# The in-memory path batches by index gathers: 10.7x the batches/s of DataLoader(TensorDataset) here.
IN_MEMORY_SPEEDUP = 10.0
# Draft JPEG decode + uint8: 0.90 vs 1.63 ms per image on the demo images (BENCHMARKS.md): 45 % less work.
DRAFT_DECODE_SAVING = 0.45
# Worker memory growing faster than this while measuring is not a cache warming up.
COPY_ON_READ_BYTES_PER_MIN = 100 * MIB
# Restarting the workers each epoch must cost at least this share of the time to be worth a fix (0.5 %).
MIN_RESTART_GAIN = 1.005


@register
class InMemory(Rule):
    id = "in_memory"
    acts_on = "input"
    changes = ("loader",)
    summary = "tensors already in memory batched by one index gather instead of sample by sample"

    def propose(self, e: Evidence) -> Recommendation | None:
        loader = main_loader(e.loaders)
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


@register
class PinMemory(Rule):
    id = "pin_memory"
    acts_on = "input"
    changes = ("loader",)
    summary = "pinned host memory and non-blocking copies to the GPU"
    injects = ("pin_memory",)

    def propose(self, e: Evidence) -> Recommendation | None:
        loader = main_loader(e.loaders)
        if e.device != "cuda" or loader is None or loader.pin_memory or e.fractions.transfer <= 0.02:
            return None
        return Recommendation(
            "pin_memory", "Pin host memory and copy with non_blocking=True",
            f"{e.fractions.transfer:.0%} of each step is spent blocked copying batches to the GPU from pageable memory",
            "DataLoader(..., pin_memory=True) and x.to('cuda', non_blocking=True)  # or trainfast.DevicePrefetcher",
            speedup_of_part(e.fractions.transfer, 10.0), overrides={"pin_memory": True},
            basis_reason=f"assumed 10x faster copies from pinned memory; {VERIFY_IT}")


@register
class PersistentWorkers(Rule):
    id = "persistent_workers"
    acts_on = "input"
    changes = ("loader",)
    summary = "the loader's workers kept alive between epochs instead of restarted"
    injects = ("persistent_workers",)
    replaces_window = True  # the whole run's measured restarts, when it has them

    def propose(self, e: Evidence) -> Recommendation | None:
        return warned(self._propose(e), e.loaders, kept=True)

    def _propose(self, e: Evidence) -> Recommendation | None:
        loader = main_loader(e.loaders)
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
        if gain is not None and gain < MIN_RESTART_GAIN:
            return None
        return Recommendation(
            "persistent_workers", "Keep the loader's workers alive between epochs",
            f"every epoch restarts {loader.num_workers} workers: {startup:.2f} s from iter() to the first batch"
            + (f", against a {epoch_s:.1f} s epoch" if epoch_s > 0 else ""),
            "DataLoader(..., persistent_workers=True)", gain, overrides={"persistent_workers": True},
            gain_basis="measured")

    def propose_run(self, e: Evidence, run: RunEvidence) -> Recommendation | None:
        """Over a whole run: the epoch starts after the first, less one first batch each (what a kept worker still
        takes to deliver it: the steps' median data wait)."""
        return warned(self._propose_run(run), run.training_loaders, kept=True)

    def _propose_run(self, run: RunEvidence) -> Recommendation | None:
        restarts = run.restarts_s
        persistent = [s.persistent_workers for s in run.training_loaders]
        if not restarts or not persistent or any(persistent) or run.share["epoch_start"] <= 0:
            return None
        wall = run.wall_s
        kept = (run.step_wait_s or 0.0) * len(restarts)
        saved = max(0.0, sum(restarts) - kept)
        gain = wall / (wall - saved) if wall > saved else None
        if gain is None or gain < MIN_RESTART_GAIN:
            return None
        return Recommendation(
            "persistent_workers", "Keep the loader's workers alive between epochs",
            f"{len(restarts)} epoch(s) after the first restarted the loader's workers: {sum(restarts):.1f} s "
            f"from iter() to the first batch, against {kept:.2f} s for a first batch from kept workers (the "
            "steps' median data wait)",
            "DataLoader(..., persistent_workers=True)", gain, overrides={"persistent_workers": True},
            gain_basis="measured", run_gain=gain)


def _restart_cost(loader: LoaderStats, cost: Periodic, slow_run: int, startup: float) -> Recommendation | None:
    """persistent_workers from the epoch-start steps' excess (periodic.py `epoch_cost`): the last epoch's shutdown,
    the fork and the wait for the first batch, not iter() to the first batch alone. `slow_run`: the slow steps from
    each epoch start (periodic.py `Periodic.span`); those after the first stay slow with persistent workers. None
    when the epoch starts did not stand out from the other steps: the restart hides within their spread."""
    gain = cost.gain
    if not cost.stands_out or gain is None or gain < MIN_RESTART_GAIN:
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


@register
class PrefetchFactor(Rule):
    id = "prefetch_factor"
    acts_on = "input"
    changes = ("loader",)
    summary = "more batches queued per worker, for data wait that comes in spikes"
    injects = ("prefetch_factor",)

    def propose(self, e: Evidence) -> Recommendation | None:
        loader = main_loader(e.loaders)
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


@register
class ShmSize(Rule):
    id = "shm_size"
    acts_on = "input"
    summary = "room in /dev/shm for the workers' batches (a full one kills them with a bus error)"

    def propose(self, e: Evidence) -> Recommendation | None:
        loader = main_loader(e.loaders)
        if loader is None or loader.num_workers == 0 or e.shm_bytes is None or not loader.batch_bytes:
            return None
        need = shm_needed_bytes(loader.num_workers, loader.prefetch_factor, loader.batch_bytes)
        if e.shm_bytes >= need:
            return None
        return Recommendation(
            "shm_size", "Give /dev/shm more room",
            f"{loader.num_workers} workers x prefetch {loader.prefetch_factor or 2} x "
            f"{format_bytes(loader.batch_bytes)} batches need ~{format_bytes(need)} of shared memory with margin; "
            f"/dev/shm has {format_bytes(e.shm_bytes)} free (a full /dev/shm kills workers with a bus error)",
            "docker run --shm-size=8g ...  (or --ipc=host); or fewer workers / a lower prefetch_factor", None,
            basis_reason="a fix against a crash, not for speed")


@register
class DecodeSize(Rule):
    id = "decode_size"
    acts_on = "input"
    changes = ("loader",)
    summary = "JPEGs decoded at the size trained (Pillow's draft, or packed pre-sized)"

    def propose(self, e: Evidence) -> Recommendation | None:
        loader = main_loader(e.loaders)
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


@register
class CopyOnRead(Rule):
    id = "copy_on_read"
    acts_on = "input"
    changes = ("loader",)
    summary = "the dataset's per-sample lists in numpy arrays, not Python lists the workers copy page by page"

    def propose(self, e: Evidence) -> Recommendation | None:
        loader = main_loader(e.loaders)
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
