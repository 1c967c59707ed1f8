"""The rules in their order, and the ranking."""

from __future__ import annotations

from collections.abc import Callable

from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.fixes.collectives import communication
from trainfast.diagnose.fixes.input import (
    copy_on_read,
    decode_size,
    fewer_workers,
    in_memory,
    num_workers,
    persistent_workers,
    pin_memory,
    prefetch_factor,
    shm_size,
)
from trainfast.diagnose.fixes.model import (
    amp,
    batch_size,
    bf16,
    channels_last,
    compile_model,
    contiguous,
    cpu_threads,
    cudnn_benchmark,
    fp32,
    host_sync,
    threads,
)
from trainfast.diagnose.records.findings import Recommendation

RULES: tuple[Callable[[Evidence], Recommendation | None], ...] = (
    num_workers, fewer_workers, cpu_threads, threads, in_memory, pin_memory, persistent_workers, prefetch_factor, amp,
    fp32, bf16, compile_model, channels_last, contiguous, cudnn_benchmark, host_sync, shm_size, decode_size,
    copy_on_read, batch_size, communication)


def recommend(e: Evidence) -> list[Recommendation]:
    """Every rule that applies: the measured gains first, then the estimates (an estimate never outranks a
    measurement), each largest first; fixes with no figure come last."""
    found = [r for rule in RULES if (r := rule(e)) is not None]
    return sorted(found, key=lambda r: (r.gain_basis == "estimate", -(r.expected_gain or 0.0)))
