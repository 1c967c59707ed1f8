"""auto.py: every "auto" loader setting, resolved by pure functions, each with its reason."""

from __future__ import annotations

import math
from typing import Any

import pytest

from trainfast.loader.auto import (
    IN_FLIGHT_BATCHES,
    MAX_AUTO_WORKERS,
    TINY_DATASET,
    LoaderPlan,
    plan_loader,
    split_cpu,
    threads_beside_workers,
)

SETTINGS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor", "drop_last")


def plan(**overrides: Any) -> LoaderPlan:
    kwargs: dict[str, Any] = {"workers": "auto", "pin_memory": "auto", "prefetch_factor": "auto",
                              "persistent_workers": "auto", "drop_last": "auto", "shuffle": True,
                              "dataset_len": 10_000, "in_memory": False, "target": "cuda", "cpus": 16, "devices": 1}
    kwargs.update(overrides)
    return plan_loader(**kwargs)


def reason_for(p: LoaderPlan, setting: str) -> str:
    found = [r for r in p.reasons if r.startswith(setting + "=")]
    assert len(found) == 1, f"expected one reason for {setting} in {p.reasons}"
    return found[0]


# ---------------------------------------------------------------------------------------------------- num_workers

@pytest.mark.parametrize(("overrides", "workers", "reason_bits"), [
    ({"in_memory": True}, 0, ["num_workers=0:", "in memory"]),
    ({"in_memory": True, "target": "cpu"}, 0, ["num_workers=0:", "in memory"]),
    ({"dataset_len": TINY_DATASET - 1}, 0, ["num_workers=0:", f"{TINY_DATASET - 1} samples (< {TINY_DATASET})"]),
    ({"dataset_len": 0, "target": "cpu"}, 0, ["num_workers=0:", f"0 samples (< {TINY_DATASET})"]),
    ({"dataset_len": TINY_DATASET}, 15, ["num_workers=15:"]),
    # CUDA: one core per device's main process, the rest as workers, capped
    ({"cpus": 16, "devices": 1}, 15, ["num_workers=15:", "16 usable CPUs / 1 device(s)"]),
    ({"cpus": 16, "devices": 4}, 3, ["num_workers=3:", "16 usable CPUs / 4 device(s)"]),
    ({"cpus": 8, "devices": 2}, 3, ["num_workers=3:"]),
    ({"cpus": 64, "devices": 1}, MAX_AUTO_WORKERS, [f"num_workers={MAX_AUTO_WORKERS}:", "64 usable CPUs"]),
    ({"cpus": 256, "devices": 2}, MAX_AUTO_WORKERS, [f"num_workers={MAX_AUTO_WORKERS}:"]),
    ({"cpus": 2, "devices": 1}, 1, ["num_workers=1:"]),
    ({"cpus": 1, "devices": 1}, 1, ["num_workers=1:"]),
    ({"cpus": 4, "devices": 8}, 1, ["num_workers=1:"]),   # more devices than CPUs: still one worker
    ({"cpus": 4, "devices": 0}, 3, ["num_workers=3:"]),   # devices=0 treated as 1, no ZeroDivisionError
    # CPU training: workers share the cores with the compute threads (split_cpu)
    ({"target": "cpu", "cpus": 16}, 8, ["num_workers=8:", "16 usable CPUs shared with 8 compute thread(s)"]),
    ({"target": "cpu", "cpus": 2}, 1, ["num_workers=1:", "2 usable CPUs shared with 1 compute thread(s)"]),
    ({"target": "cpu", "cpus": 1}, 1, ["num_workers=1:"]),
    ({"target": "cpu", "cpus": 7}, 3, ["num_workers=3:", "shared with 4 compute thread(s)"]),
    # explicit worker counts are honoured, whatever the dataset
    ({"workers": 3, "in_memory": True}, 3, ["num_workers=3 (given)"]),
    ({"workers": 2, "dataset_len": 10}, 2, ["num_workers=2 (given)"]),
    ({"workers": 0}, 0, ["num_workers=0 (given)"]),
    ({"workers": 40, "cpus": 2}, 40, ["num_workers=40 (given)"]),
])
def test_plan_num_workers(overrides: dict[str, Any], workers: int, reason_bits: list[str]) -> None:
    p = plan(**overrides)
    assert p.num_workers == workers
    reason = reason_for(p, "num_workers")
    for bit in reason_bits:
        assert bit in reason
    assert p.in_memory == overrides.get("in_memory", False)


@pytest.mark.parametrize("cpus", [1, 2, 3, 4, 8, 16, 17, 33, 64, 128])
@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_auto_workers_never_exceed_cap_or_cpus(cpus: int, target: str) -> None:
    """MAX_AUTO_WORKERS is "the most workers auto starts per device": the CPU is the device when training on it."""
    n = plan(cpus=cpus, target=target).num_workers
    assert 1 <= n <= MAX_AUTO_WORKERS
    assert n <= max(1, cpus - 1) if target == "cuda" else n <= max(1, cpus // 2)


def test_cpu_target_uses_split_cpu() -> None:
    for cpus in range(1, 2 * MAX_AUTO_WORKERS + 1):  # where split_cpu stays under the cap
        assert plan(target="cpu", cpus=cpus).num_workers == split_cpu(cpus)[0]


# ---------------------------------------------------------------------------------------------------- pin_memory

@pytest.mark.parametrize(("target", "given", "expected", "reason"), [
    ("cuda", "auto", True, "pin_memory=True (target is CUDA: page-locked buffers copy asynchronously)"),
    ("cpu", "auto", False, "pin_memory=False"),
    ("cpu", True, True, "pin_memory=True"),
    ("cuda", False, False, "pin_memory=False"),
    ("cuda", True, True, "pin_memory=True"),
])
def test_plan_pin_memory(target: str, given: bool | str, expected: bool, reason: str) -> None:
    p = plan(target=target, pin_memory=given)
    assert p.pin_memory is expected
    assert reason_for(p, "pin_memory") == reason


@pytest.mark.parametrize("in_memory", [False, True])
def test_pin_memory_auto_also_for_in_memory_cuda(in_memory: bool) -> None:
    assert plan(in_memory=in_memory, target="cuda").pin_memory is True
    assert plan(in_memory=in_memory, target="cpu").pin_memory is False


# ---------------------------------------------------------------------------------------------- persistent_workers

@pytest.mark.parametrize(("overrides", "expected"), [
    ({}, True),                                            # auto, 15 workers
    ({"workers": 1}, True),
    ({"workers": 0}, False),                               # auto, no workers to keep
    ({"in_memory": True}, False),
    ({"dataset_len": 10}, False),
    ({"persistent_workers": False}, False),
    ({"persistent_workers": True, "workers": 2}, True),
    ({"persistent_workers": True, "workers": 0}, False),   # DataLoader refuses persistence without workers
    ({"persistent_workers": True, "in_memory": True}, False),
])
def test_plan_persistent_workers(overrides: dict[str, Any], expected: bool) -> None:
    p = plan(**overrides)
    assert p.persistent_workers is expected
    if p.num_workers > 0:
        assert reason_for(p, "persistent_workers").startswith(f"persistent_workers={expected}")


# ------------------------------------------------------------------------------------------------- prefetch_factor

@pytest.mark.parametrize(("workers", "given", "expected"), [
    (0, "auto", None),
    (0, 5, None),        # DataLoader refuses a prefetch_factor without workers
    (1, "auto", 4),      # IN_FLIGHT_BATCHES over one worker
    (2, "auto", 2),
    (3, "auto", 2),      # never below 2
    (4, "auto", 2),
    (16, "auto", 2),
    (2, 5, 5),           # explicit: honoured
    (1, 1, 1),
])
def test_plan_prefetch_factor(workers: int, given: int | str, expected: int | None) -> None:
    p = plan(workers=workers, prefetch_factor=given)
    assert p.prefetch_factor == expected
    if expected is not None:
        in_flight = workers * expected
        assert reason_for(p, "prefetch_factor") == f"prefetch_factor={expected} ({in_flight} batches in flight)"


@pytest.mark.parametrize("workers", range(1, 33))
def test_auto_prefetch_keeps_enough_batches_in_flight(workers: int) -> None:
    pf = plan(workers=workers).prefetch_factor
    assert pf is not None and pf >= 2
    assert workers * pf >= IN_FLIGHT_BATCHES
    assert pf == max(2, math.ceil(IN_FLIGHT_BATCHES / workers))


# ------------------------------------------------------------------------------------------------------- drop_last

@pytest.mark.parametrize(("shuffle", "given", "expected", "reason"), [
    (True, "auto", True, "drop_last=True (training: equal batch shapes every step)"),
    (False, "auto", False, "drop_last=False"),
    (True, False, False, "drop_last=False"),
    (False, True, True, "drop_last=True"),
    (True, True, True, "drop_last=True"),
])
def test_plan_drop_last(shuffle: bool, given: bool | str, expected: bool, reason: str) -> None:
    p = plan(shuffle=shuffle, drop_last=given)
    assert p.drop_last is expected
    assert reason_for(p, "drop_last") == reason


# --------------------------------------------------------------------------------------------------------- reasons

PLANS = [
    {},
    {"target": "cpu"},
    {"target": "cpu", "cpus": 1},
    {"in_memory": True},
    {"dataset_len": 5, "shuffle": False},
    {"workers": 0, "pin_memory": True, "drop_last": False},
    {"workers": 3, "prefetch_factor": 6, "persistent_workers": False},
    {"cpus": 64, "devices": 8, "pin_memory": False},
]


@pytest.mark.parametrize("overrides", PLANS, ids=[repr(p) for p in PLANS])
def test_every_plan_explains_each_setting_once(overrides: dict[str, Any]) -> None:
    p = plan(**overrides)
    named = [r.split("=", 1)[0] for r in p.reasons]
    assert len(named) == len(set(named)), p.reasons
    assert set(named) <= set(SETTINGS)
    always = {"num_workers", "pin_memory", "drop_last"}
    with_workers = {"persistent_workers", "prefetch_factor"}
    assert set(named) == (always | with_workers if p.num_workers > 0 else always) | (set(named) & with_workers)
    # each reason states the value that was chosen
    values = {"num_workers": p.num_workers, "pin_memory": p.pin_memory, "drop_last": p.drop_last,
              "persistent_workers": p.persistent_workers, "prefetch_factor": p.prefetch_factor}
    for setting in always | (with_workers if p.num_workers > 0 else set()):
        assert reason_for(p, setting).startswith(f"{setting}={values[setting]}")
    assert p.describe() == "; ".join(p.reasons)
    assert all(r and ";" not in r for r in p.reasons)  # describe() stays splittable


def test_plan_explains_given_settings_it_overrides() -> None:
    """An explicit persistent_workers=True / prefetch_factor=4 that cannot apply (no workers) is dropped: say so."""
    p = plan(workers=0, persistent_workers=True, prefetch_factor=4)
    assert (p.persistent_workers, p.prefetch_factor) == (False, None)
    text = p.describe()
    assert "persistent_workers" in text, f"the given persistent_workers=True was dropped silently: {text!r}"
    assert "prefetch_factor" in text, f"the given prefetch_factor=4 was dropped silently: {text!r}"


def test_describe_example() -> None:
    p = plan(target="cuda", cpus=16, devices=4, shuffle=True)
    assert p.describe() == (
        "num_workers=3: 16 usable CPUs / 4 device(s), one core kept per device's main process; "
        "pin_memory=True (target is CUDA: page-locked buffers copy asynchronously); "
        "persistent_workers=True (no worker restart each epoch); "
        "prefetch_factor=2 (6 batches in flight); "
        "drop_last=True (training: equal batch shapes every step)")


def test_plan_is_frozen() -> None:
    p = plan()
    with pytest.raises(AttributeError):
        p.num_workers = 3  # type: ignore[misc]


# --------------------------------------------------------------------------------------- split_cpu / threads_beside

@pytest.mark.parametrize(("cpus", "expected"), [(1, (1, 1)), (2, (1, 1)), (3, (1, 2)), (4, (2, 2)), (16, (8, 8)),
                                                (17, (8, 9))])
def test_split_cpu(cpus: int, expected: tuple[int, int]) -> None:
    assert split_cpu(cpus) == expected


@pytest.mark.parametrize("cpus", range(1, 65))
def test_split_cpu_consistent_with_threads_beside_workers(cpus: int) -> None:
    workers, threads = split_cpu(cpus)
    assert threads_beside_workers(cpus, workers) == threads
    assert workers >= 1 and threads >= 1
    assert workers + threads <= max(2, cpus)


@pytest.mark.parametrize(("cpus", "workers", "expected"), [(4, 1, 3), (4, 4, 1), (4, 8, 1), (1, 1, 1), (8, 0, 8)])
def test_threads_beside_workers(cpus: int, workers: int, expected: int) -> None:
    assert threads_beside_workers(cpus, workers) == expected
