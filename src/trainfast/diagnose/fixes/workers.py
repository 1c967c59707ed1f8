"""How many loader workers: more where the step waits for batches (as many as overlap a batch's making with the
step, and where the reads wait, as many as Little's law needs beyond the cores), fewer where more workers than cores
only take turns on them. More worker processes where the loop sets attributes on the dataset after the loader
started say they would never see them (`warned`; the persistent_workers fix of input.py too)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.fixes.rule import MIN_GAIN, VERIFY_IT, Rule, register
from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.records.steps import LoaderStats, main_loader
from trainfast.diagnose.records.trials import TrialRequest
from trainfast.diagnose.verdict import DATA_WAIT_BOUND, REPLAY_POSSIBLE
from trainfast.loader.auto import threads_beside_workers
from trainfast.loader.latency import MAX_THREADS
from trainfast.units import format_bytes

# Workers queued for a core this share of their time take turns on the cores: fewer of them is worth saying.
QUEUED_CONTEND = 0.2


def unseen_by_workers(loaders: Sequence[LoaderStats], *, kept: bool) -> str | None:
    """Why workers (`kept`: kept between epochs) would train on another dataset than the loop's: the attributes it
    set on a loader's dataset after the loader started. None where it set none."""
    loader = next((s for s in loaders if s.dataset_set_after_start), None)
    if loader is None:
        return None
    names = loader.dataset_set_after_start
    what = ", ".join(f"{loader.dataset}.{name}" for name in names[:3]) + (
        f" and {len(names) - 3} more" if len(names) > 3 else "")
    copy = "keep the copy of the dataset made when they first start" if kept else \
        "hold a copy of the dataset made when they start"
    return (f"the loop sets {what} after loader #{loader.index} started; worker processes {copy} and never see it: "
            f"{'kept' if kept else 'more'} workers would train a different model")


def warned(fix: Recommendation | None, loaders: Sequence[LoaderStats], *, kept: bool) -> Recommendation | None:
    """The fix, saying (in its `why`, and as `changes_training`) that its workers would not see what the loop sets
    on the dataset, where it sets something."""
    caveat = unseen_by_workers(loaders, kept=kept) if fix is not None else None
    if fix is None or caveat is None:
        return fix
    return replace(fix, why=f"{fix.why}; but {caveat}", changes_training=caveat)


@register
class NumWorkers(Rule):
    id = "num_workers"
    acts_on = "input"
    changes = ("loader",)
    summary = ("the loader's worker processes (or threads): more where the step waits for batches, Little's law "
               "where the reads wait on storage, fewer where they outnumber the cores")
    injects = ("num_workers", "persistent_workers", "threads")

    def propose(self, e: Evidence) -> Recommendation | None:
        more = _more_workers(e)
        return warned(more, e.loaders, kept=False) if more is not None and more.overrides else \
            more or _fewer_workers(e)

    def trials(self, e: Evidence) -> tuple[TrialRequest, ...]:
        """On the CPU, the model step at the intra-op threads the workers would leave it: the fix cites it."""
        fix = _more_workers(e) if e.device == "cpu" else None
        threads = (fix.overrides or {}).get("threads") if fix is not None else None
        return (TrialRequest("threads", f"{threads} intra-op thread(s)", threads),) \
            if threads is not None and threads < e.threads else ()


def _more_workers(e: Evidence) -> Recommendation | None:
    loader = main_loader(e.loaders)
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
        proposed = threads_beside_workers(e.cpus, k)
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
        f"~{per_batch * 1e3:.1f} ms per batch, so {k} {'overlaps' if k == 1 else 'overlap'} it with the "
        f"{compute * 1e3:.1f} ms of compute{caveat}",
        f"DataLoader(..., num_workers={k}, persistent_workers=True){threads}  # or trainfast.make_loader(dataset, "
        f"batch_size) / trainfast train --workers auto", gain,
        overrides={"num_workers": k, "persistent_workers": True} | thread_override,
        gain_basis="measured" if measured else "estimate",
        basis_reason=None if measured else f"the model step at {proposed} thread(s) could not be timed; {VERIFY_IT}")


def _overlap_waits(e: Evidence, loader: LoaderStats, wait: float, compute: float) -> Recommendation | None:
    """Batches whose making mostly waits (on storage, a network): as many in flight as the step needs (Little's
    law: in flight = rate x the time a batch takes), beyond the cores, up to where the CPU becomes the limit."""
    workers, k0, step = e.workers, loader.num_workers, wait + compute
    assert workers is not None
    # measured inside the workers where they could time themselves; else, input-bound, k0 workers deliver one batch
    # per step, so each spends k0 steps on one; without workers the main thread makes each batch in the step's wait
    per_batch = workers.batch_s or (k0 * step if k0 else wait)
    cpu_per_batch = workers.busy * per_batch
    if e.device == "cpu":  # the workers' CPU and the model step's (at most its threads busy) share the cores
        floor = (cpu_per_batch + compute * min(e.threads, e.cpus)) / e.cpus
    else:  # one core stays with the process feeding the GPU
        floor = cpu_per_batch / max(1, e.cpus - 1)
    target = max(compute, floor)
    k = min(MAX_THREADS, max(k0 + 1, math.ceil(per_batch / target)))
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
    capped = (f" (capped at {MAX_THREADS}: trainfast.make_loader's threads hide more latency per process)"
              if k == MAX_THREADS else "")
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


def _fewer_workers(e: Evidence) -> Recommendation | None:
    """More loader workers than cores to run them: they take turns, and on the CPU they take the model step's."""
    loader = main_loader(e.loaders)
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
