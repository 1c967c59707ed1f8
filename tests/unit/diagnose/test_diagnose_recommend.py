"""Recommendation rules: when each fires, what it says, and the ranking by expected gain."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.evidence.monitored import worker_private_growth
from trainfast.diagnose.fixes import recommend
from trainfast.diagnose.fixes.notes import not_offered
from trainfast.diagnose.fixes.notes import unaddressed_input as why_no_input_fix
from trainfast.diagnose.records.findings import Verdict
from trainfast.diagnose.records.steps import Fractions, LoaderStats
from trainfast.diagnose.records.trials import Trial, Trials
from trainfast.diagnose.verdict import precision_may_pay, with_peak
from trainfast.monitor.series import Series


def loader(**overrides: Any) -> LoaderStats:
    values: dict[str, Any] = {"index": 0, "kind": "DataLoader", "dataset": "JpegDataset", "num_workers": 0,
                              "pin_memory": False, "persistent_workers": False, "prefetch_factor": None,
                              "batch_size": 64, "in_memory": False, "decode": None, "batches_per_epoch": 100,
                              "batches": 30, "wait_s": 1.0, "epochs": 1, "startup_s": [0.01],
                              "batch_bytes": 64 * 3 * 64 * 64, "image_hw": (64, 64)}
    return LoaderStats(**(values | overrides))


def evidence(**overrides: Any) -> Evidence:
    values: dict[str, Any] = {"verdict": "compute-bound", "device": "cpu", "fractions": Fractions(0, 0, 0, 1),
                              "step_s": 0.1, "steps": 30, "samples_per_s": 640.0, "syncs_per_step": 0.0, "cpus": 8,
                              "threads": 4}
    return Evidence(**(values | overrides))


def ids(e: Evidence) -> list[str]:
    return [r.id for r in recommend(e)]


INPUT_BOUND = Fractions(0.6, 0, 0, 0.4)


def test_input_bound_with_no_workers_ranks_num_workers_first() -> None:
    recs = recommend(evidence(verdict="input-bound", fractions=INPUT_BOUND, loaders=(loader(),), device="cuda"))
    top = recs[0]
    assert top.id == "num_workers" and "num_workers=2" in top.fix  # 60 ms of loading over 40 ms of compute
    assert top.expected_gain == pytest.approx(100 / 40)  # step goes from 100 ms to max(40, 60/2) ms
    assert "60% of each step" in top.why and "60.0 ms of a 100.0 ms step" in top.why


def test_num_workers_on_the_cpu_also_sets_threads_and_is_bounded_by_cores() -> None:
    e = evidence(verdict="input-bound", fractions=Fractions(0.9, 0, 0, 0.1), loaders=(loader(),), cpus=2, threads=2)
    top = recommend(e)[0]
    assert top.id == "num_workers" and "num_workers=2" in top.fix and "torch.set_num_threads(1)" in top.fix
    assert top.expected_gain == pytest.approx(2.0)  # 100 ms of CPU work on 2 cores
    assert "upper bound" in top.why


def test_more_workers_when_existing_ones_cannot_keep_up() -> None:
    e = evidence(verdict="input-bound", fractions=INPUT_BOUND, loaders=(loader(num_workers=2),), device="cuda", cpus=16)
    rec = next(r for r in recommend(e) if r.id == "num_workers")
    assert "num_workers=5" in rec.fix  # each worker needs 2 x 100 ms per batch; 5 keep up with 40 ms steps


def test_no_worker_advice_when_not_input_bound_or_cores_are_used_up() -> None:
    assert "num_workers" not in ids(evidence(loaders=(loader(),)))
    fast_loader = evidence(fractions=INPUT_BOUND, loaders=(loader(),), device="cuda", loader_headroom=3.0)
    assert "num_workers" not in ids(fast_loader)
    full = evidence(fractions=INPUT_BOUND, loaders=(loader(num_workers=7),), device="cuda", cpus=8)
    assert "num_workers" not in ids(full)


def thread_trials(factor: float) -> Trials:
    return Trials(trials={"threads:1": Trial("threads", "1 intra-op thread(s)", factor=factor, low=factor,
                                              high=factor, rounds=7, faster_rounds=7 if factor > 1 else 0,
                                              base_s=0.1, value=1)})


def test_cpu_threads_only_when_its_trial_measured_a_gain() -> None:
    """Workers and threads oversubscribe the cores; fewer threads is offered only where the model step on them
    measured faster (1 thread for 2 measured 0.84x under --verify on a public script)."""
    e = evidence(loaders=(loader(num_workers=2),), cpus=2, threads=2, compute_s=0.1)
    assert "cpu_threads" not in ids(e)  # not measured
    assert "cpu_threads" not in ids(replace(e, trials=thread_trials(0.6)))  # measured slower
    rec = next(r for r in recommend(replace(e, trials=thread_trials(1.25))) if r.id == "cpu_threads")
    assert "torch.set_num_threads(1)" in rec.fix and "2 loader worker(s) and 2 intra-op threads share 2 CPUs" in rec.why
    assert rec.gain_basis == "measured" and rec.expected_gain == pytest.approx(1.25)
    assert "cpu_threads" not in ids(replace(e, threads=1, cpus=4, trials=thread_trials(1.25)))
    assert "cpu_threads" not in ids(replace(e, device="cuda", trials=thread_trials(1.25)))


def test_no_thread_advice_that_changes_nothing() -> None:
    """One intra-op thread already: two workers on two CPUs oversubscribe them, but 1 thread is the floor."""
    e = evidence(loaders=(loader(num_workers=2),), cpus=2, threads=1)
    assert "cpu_threads" not in ids(e)
    starved = evidence(verdict="input-bound", fractions=Fractions(0.9, 0, 0, 0.1), loaders=(loader(),), cpus=2,
                       threads=1)
    rec = next(r for r in recommend(starved) if r.id == "num_workers")
    assert "set_num_threads" not in rec.fix and "fewer intra-op threads" not in rec.why
    assert "threads" not in rec.overrides


def test_persistent_workers_needs_an_epoch_length_or_a_second_epoch() -> None:
    """An IterableDataset has no len(): after one epoch nothing says what a restart costs against an epoch."""
    once = evidence(loaders=(loader(num_workers=2, batches_per_epoch=None, startup_s=[2.0], batches=30),))
    assert "persistent_workers" not in ids(once)
    twice = evidence(loaders=(loader(num_workers=2, batches_per_epoch=None, startup_s=[2.0, 2.0], batches=40,
                                     epochs=2),))
    rec = next(r for r in recommend(twice) if r.id == "persistent_workers")
    assert rec.expected_gain == pytest.approx(1 + 2.0 / (40 * 0.1))  # the seen epoch: at most 40 batches


def test_workers_that_would_never_see_what_the_loop_sets_on_the_dataset_say_so() -> None:
    """A curriculum (`ds.noise` set each step) or an epoch attribute set after the loader started: more workers, or
    workers kept between epochs, hold the copy made when they started (capture/dataset_watch.py)."""
    more = evidence(verdict="input-bound", fractions=INPUT_BOUND, loaders=(loader(dataset_set_after_start=["noise"]),),
                    device="cuda")
    rec = next(r for r in recommend(more) if r.id == "num_workers")
    assert rec.changes_training == ("the loop sets JpegDataset.noise after loader #0 started; worker processes hold a "
                                    "copy of the dataset made when they start and never see it: more workers would "
                                    "train a different model")
    assert rec.why.endswith(f"; but {rec.changes_training}") and rec.overrides
    kept = evidence(loaders=(loader(num_workers=2, batches_per_epoch=None, startup_s=[2.0, 2.0], batches=40, epochs=2,
                                    dataset_set_after_start=["epoch"]),))
    rec = next(r for r in recommend(kept) if r.id == "persistent_workers")
    assert rec.changes_training is not None and "JpegDataset.epoch" in rec.changes_training
    assert rec.changes_training.endswith("kept workers would train a different model")


def test_in_memory_names_a_subset_of_tensors() -> None:
    e = evidence(loaders=(loader(in_memory=True, num_workers=1, dataset="Subset of TensorDataset"),),
                 fractions=INPUT_BOUND)
    rec = next(r for r in recommend(e) if r.id == "in_memory")
    assert "iterates a Subset of TensorDataset sample by sample" in rec.why and "num_workers" not in ids(e)


@pytest.mark.parametrize(("overrides", "expected", "absent"), [
    ({"loaders": (loader(in_memory=True, num_workers=2),), "fractions": INPUT_BOUND}, "in_memory", "num_workers"),
    ({"device": "cuda", "loaders": (loader(),), "fractions": Fractions(0, 0.2, 0, 0.8)}, "pin_memory", None),
    ({"loaders": (loader(num_workers=4, startup_s=[2.0, 2.0], epochs=2),)}, "persistent_workers", None),
    ({"loaders": (loader(num_workers=4, prefetch_factor=2),), "fractions": INPUT_BOUND, "wait_spike_ratio": 5.0},
     "prefetch_factor", None),
    ({"device": "cuda"}, "amp", None),
    ({"device": "cpu", "bf16_supported": True}, "amp", None),  # a CPU with native bf16 (AMX, AVX512-BF16, ARM)
    ({"device": "cuda", "autocast": (("cuda", "float16"),), "scaler_steps": 10, "scaler_skipped_steps": 2,
      "bf16_supported": True},
     "bf16", None),
    ({"device": "cuda", "autocast": (("cuda", "bfloat16"),)}, "compile", "amp"),
    ({"compiled": True, "recompiled_frames": 3, "graph_breaks": 1}, "compile", None),
    ({"conv_weights": 5}, "channels_last", None),
    ({"device": "cuda", "conv_weights": 5, "autocast": (("cuda", "bfloat16"),)}, "cudnn_benchmark", None),
    ({"syncs_per_step": 1.0, "device": "cuda", "fractions": Fractions(0, 0, 0.2, 0.8)}, "host_sync", None),
    ({"loaders": (loader(num_workers=4, prefetch_factor=2),), "shm_bytes": 2**20}, "shm_size", None),
    ({"loaders": (loader(decode="full"),), "fractions": INPUT_BOUND}, "decode_size", None),
    ({"loaders": (loader(),), "fractions": INPUT_BOUND, "jpeg_decoded_pixels": 400.0 * 300}, "decode_size", None),
    ({"fractions": Fractions(0, 0, 0.4, 0.6)}, "batch_size", None),
    ({"loaders": (loader(num_workers=4),), "worker_private_growth_per_min": 500 * 2**20}, "copy_on_read", None),
])
def test_each_rule_fires_on_its_evidence(overrides: dict[str, Any], expected: str, absent: str | None) -> None:
    found = ids(evidence(**overrides))
    assert expected in found
    if absent:
        assert absent not in found


def test_decode_size_also_points_to_trainfast_pack() -> None:
    rec = next(r for r in recommend(evidence(loaders=(loader(decode="full"),), fractions=INPUT_BOUND))
               if r.id == "decode_size")
    assert "img.draft('RGB', (w, h))" in rec.fix  # the in-script fix first
    assert "trainfast pack SRC DST --image-size N, then trainfast train --data DST" in rec.fix
    assert "pre-sized" in rec.why and "one file opened per shard" in rec.why


@pytest.mark.parametrize("overrides", [
    {"device": "cpu"},                                   # no AMP advice on a CPU without native bf16
    {"device": "cpu", "bf16_supported": True, "autocast": (("cpu", "bfloat16"),)},  # already autocast
    {"device": "cuda", "conv_weights": 5, "conv_weights_channels_last": 5, "cudnn_benchmark": True,
     "autocast": (("cuda", "bfloat16"),),
     "compiled": True},
    {"loaders": (loader(num_workers=4, prefetch_factor=2),), "shm_bytes": 2**40},
    {"fractions": Fractions(0, 0, 0.4, 0.6), "gpu_memory_fraction": 0.9},  # no room for a bigger batch
])
def test_rules_stay_quiet_without_evidence(overrides: dict[str, Any]) -> None:
    assert not {"amp", "cudnn_benchmark", "shm_size", "batch_size", "channels_last"} & set(ids(evidence(**overrides)))


def test_ranked_measured_first_then_estimates_each_by_expected_gain_unknown_last() -> None:
    e = evidence(verdict="input-bound", fractions=INPUT_BOUND, loaders=(loader(decode="full"),), device="cuda",
                 syncs_per_step=1.0, conv_weights=3, cudnn_benchmark=False)
    recs = recommend(e)
    bases = [r.gain_basis for r in recs]
    assert bases == sorted(bases, key=lambda b: b == "estimate") and "measured" in bases and "estimate" in bases
    for basis in ("measured", "estimate"):
        gains = [r.expected_gain for r in recs if r.gain_basis == basis]
        known = [g for g in gains if g is not None]
        assert known == sorted(known, reverse=True) and gains[len(known):] == [None] * (len(gains) - len(known))
    for r in recs:
        assert set(r.to_json()) == {"id", "title", "why", "fix", "expected_gain", "measured_gain", "gain_basis",
                                    "gain_basis_reason", "overrides", "run_gain", "where", "changes_training"}
        assert r.changes_training is None  # nothing set on the dataset: no fix knows it changes what is learned
        assert r.why and r.fix
        assert (r.gain_basis == "estimate") == (r.basis_reason is not None), r  # an estimate says why it is one


def test_persistent_workers_not_offered_before_a_second_epoch_begins() -> None:
    """A run of one epoch (or one stopped in its first) has no worker restart to save."""
    one = evidence(loaders=(loader(num_workers=4, startup_s=[2.0], epochs=1),))
    two = evidence(loaders=(loader(num_workers=4, startup_s=[2.0, 2.0], epochs=2),))
    assert "persistent_workers" not in ids(one) and "persistent_workers" in ids(two)


@pytest.mark.parametrize(("slowdown", "gain"), [
    (1.0, 100 / 50),    # as fast on 1 thread: 90 ms of loading + 10 ms of compute share 2 cores
    (0.1, 100 / 45.5),  # 2 threads stalled on a busy machine: 10x faster on one, the loading bounds it
    (1.8, 100 / 54),    # 10 ms of compute becomes 18: 108 ms of CPU work on 2 cores
    (12.0, None),       # 120 ms on one thread, slower than the 100 ms step now: no fix
])
def test_num_workers_on_the_cpu_uses_the_measured_thread_slowdown(slowdown: float, gain: float | None) -> None:
    e = evidence(verdict="input-bound", fractions=Fractions(0.9, 0, 0, 0.1), loaders=(loader(),), cpus=2, threads=2,
                 thread_probe=(1, slowdown))
    recs = {r.id: r for r in recommend(e)}
    assert ("num_workers" in recs) == (gain is not None)
    if gain is not None:
        rec = recs["num_workers"]
        assert rec.expected_gain == pytest.approx(gain)
        change = f"{slowdown:.2f}x as long" if slowdown >= 1 else f"{1 / slowdown:.1f}x faster"
        assert f"is {change} on 1 intra-op thread" in rec.why and "upper bound" not in rec.why


def test_a_compute_heavy_step_gets_no_worker_fix_that_would_slow_it() -> None:
    """10 % data wait beside 89 % compute on 2 CPUs: fewer threads cost more than the workers save."""
    e = evidence(fractions=Fractions(0.1, 0, 0.01, 0.89), loaders=(loader(),), cpus=2, threads=2,
                 thread_probe=(1, 1.8))
    assert "num_workers" not in ids(e)


def test_host_sync_only_where_a_sync_costs_something() -> None:
    host = Fractions(0, 0, 0.2, 0.8)
    assert "host_sync" not in ids(evidence(syncs_per_step=3.0, device="cpu", fractions=host))
    assert "host_sync" in ids(evidence(syncs_per_step=3.0, device="cuda", fractions=host))
    assert "host_sync" not in ids(evidence(syncs_per_step=0.5, device="cuda", fractions=host))


def test_a_sync_per_step_of_a_gpu_bound_loop_is_not_a_fix() -> None:
    """word_language_model's loss.item() once a step: the step waits for the GPU anyway, the host is idle."""
    busy = evidence(device="cuda", syncs_per_step=1.0, fractions=Fractions(0, 0, 0.01, 0.99))
    assert "host_sync" not in ids(busy)


def test_more_workers_than_cores_is_a_ranked_fix_to_verify() -> None:
    """4 workers on 2 CPUs: not only a pre-flight warning but a fix --verify can measure."""
    recs = recommend(evidence(loaders=(loader(num_workers=4),), cpus=2, threads=1))
    fix = next(r for r in recs if r.id == "num_workers")
    assert "num_workers=2" in fix.fix and fix.overrides == {"num_workers": 2} and fix.gain_basis == "estimate"
    assert "--verify" in (fix.basis_reason or "")
    assert "num_workers" not in ids(evidence(loaders=(loader(num_workers=2),), cpus=2, threads=1))


def test_fixes_the_doctor_can_inject_say_how() -> None:
    e = evidence(verdict="input-bound", fractions=INPUT_BOUND, loaders=(loader(),), cpus=2, threads=2)
    rec = next(r for r in recommend(e) if r.id == "num_workers")
    assert rec.overrides == {"num_workers": 2, "persistent_workers": True, "threads": 1}
    cuda = next(r for r in recommend(replace(e, device="cuda", cpus=8)) if r.id == "num_workers")
    assert cuda.overrides is not None and "threads" not in cuda.overrides
    assert rec.to_json()["measured_gain"] is None


def test_cpu_bf16_advice_says_cpu_autocast_and_its_assumed_gain() -> None:
    e = evidence(device="cpu", bf16_supported=True, fractions=Fractions(0, 0, 0.2, 0.8))
    rec = next(r for r in recommend(e) if r.id == "amp")
    assert "torch.autocast('cpu', dtype=torch.bfloat16)" in rec.fix and "bf16 natively" in rec.why
    assert rec.expected_gain is not None and rec.expected_gain > 1.2


def test_an_input_bound_step_with_no_input_fix_says_why() -> None:
    """Two workers on two CPUs, still waiting: more workers would share the same cores."""
    e = evidence(verdict="input-bound", fractions=Fractions(0.66, 0, 0.02, 0.32),
                 loaders=(loader(num_workers=2, persistent_workers=True, batches_per_epoch=None),), cpus=2, threads=1)
    recs = recommend(e)
    assert not {"num_workers", "persistent_workers", "in_memory"} & {r.id for r in recs}
    why = why_no_input_fix(e, recs)
    assert why is not None and "already runs 2 worker(s) on 2 usable CPU(s)" in why and "trainfast pack" in why
    no_loader = why_no_input_fix(replace(e, loaders=()), [])
    assert no_loader is not None and "no DataLoader fed training" in no_loader
    assert why_no_input_fix(replace(e, verdict="compute-bound"), recs) is None
    fixed = evidence(verdict="input-bound", fractions=INPUT_BOUND, loaders=(loader(),), device="cuda")
    assert why_no_input_fix(fixed, recommend(fixed)) is None  # num_workers addresses it


def trial(id: str, factor: float | None, **fields: Any) -> Trial:
    measured = {"low": factor, "high": factor, "rounds": 7, "faster_rounds": 7 if factor > 1 else 0,
                "base_s": 0.1} if factor is not None else {}
    return Trial(id, id, factor=factor, **(measured | fields))


def test_the_scripts_own_precision_is_reversed_when_float32_measured_faster() -> None:
    bf16_run = evidence(autocast=(("cpu", "bfloat16"),), compute_s=0.1, conv_weights=3)
    assert "fp32" not in ids(bf16_run)  # not measured
    faster = replace(bf16_run, trials=Trials(trials={"fp32": trial("fp32", 4.0)}))
    top = recommend(faster)[0]
    assert top.id == "fp32" and top.gain_basis == "measured" and top.expected_gain == pytest.approx(4.0)
    assert "bf16 is emulated here" in top.why and top.overrides == {"autocast": False}
    assert "fp32" not in ids(replace(bf16_run, trials=Trials(trials={"fp32": trial("fp32", 0.9)})))


def test_a_candidate_the_doctor_failed_to_time_gets_no_assumed_gain() -> None:
    failed = Trials(trials={"channels_last": trial("channels_last", None, failed=True,
                                                   reason="the doctor's channels_last conversion failed")})
    rec = next(r for r in recommend(evidence(conv_weights=5, trials=failed)) if r.id == "channels_last")
    assert rec.expected_gain is None and "conversion failed" in (rec.basis_reason or "")
    unprobed = Trials(reason="FSDPNet could not be copied (...), and a replay in place would issue collectives")
    rec = next(r for r in recommend(evidence(device="cuda", trials=unprobed)) if r.id == "amp")
    assert rec.expected_gain is None and "could not be copied" in (rec.basis_reason or "")
    notes = not_offered(evidence(conv_weights=5, trials=failed))
    assert any("channels_last not measured" in n and "stopped no other" in n for n in notes)
    assert any("no candidate fix was timed on a replay" in n for n in not_offered(evidence(trials=unprobed)))


def test_no_channels_last_for_a_practice_in_use() -> None:
    """Depthwise kernels' strides fit both layouts: they are no sign of NCHW; nor is a model fed NHWC images."""
    assert "channels_last" not in ids(evidence(conv_weights=5, conv_weights_channels_last=3,
                                               conv_weights_ambiguous=2))
    assert "channels_last" not in ids(evidence(conv_weights=5, input_layout="channels_last"))
    assert "channels_last" in ids(evidence(conv_weights=5, conv_weights_ambiguous=2, input_layout="contiguous"))


def test_no_precision_hint_where_the_report_measured_it_slower() -> None:
    assert precision_may_pay(evidence())
    assert not precision_may_pay(evidence(autocast=(("cpu", "bfloat16"),)))
    assert not precision_may_pay(evidence(trials=Trials(trials={"amp": trial("amp", 0.5)})))
    verdict = with_peak(Verdict("compute-bound", "x"), {"mfu": 0.05, "peak_source": "measured", "peak_precision":
                                                        "fp32"}, "cpu", precision_hint=False)
    assert "precision" not in verdict.reason and "torch.compile" in verdict.reason


def test_the_scripts_channels_last_is_reversed_when_nchw_measured_faster() -> None:
    nhwc = evidence(conv_weights=5, conv_weights_channels_last=5, compute_s=0.1)
    assert "contiguous" not in ids(nhwc)
    rec = next(r for r in recommend(replace(nhwc, trials=Trials(trials={"contiguous": trial("contiguous", 1.3)})))
               if r.id == "contiguous")
    assert rec.gain_basis == "measured" and rec.expected_gain == pytest.approx(1.3)


def test_worker_growth_is_read_while_measuring_not_as_the_workers_shut_down() -> None:
    """Copied pages grow steadily while measuring; the sample taken as the run stopped, its workers still counted
    but half gone, would read as a fall and hide the growth (0.0)."""
    times = [float(t) for t in range(12)]
    private = [100.0 * 2**20 + t * 20 * 2**20 for t in range(11)] + [40.0 * 2**20]  # the last: shutting down
    monitor = Series(started_at=1000.0, by_metric={"workers.private_bytes": (times, private),
                                                   "workers.count": (times, [2.0] * 12),
                                                   "workers.started": (times, [2.0] * 12)})
    assert worker_private_growth(monitor, 1000.0) == 0.0  # the fall read in
    assert worker_private_growth(monitor, 1000.0, 1010.5) == pytest.approx(20 * 2**20 * 60)
