"""The collectives' fix."""

from __future__ import annotations

from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.fixes.rule import NEEDS_EDIT, speedup_of_part
from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.verdict import DATA_WAIT_BOUND

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
    gain = speedup_of_part(share, COMM_HIDDEN)
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
