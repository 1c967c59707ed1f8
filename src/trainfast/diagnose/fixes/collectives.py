"""The collectives' fixes: where the step waits in collectives across ranks (exposed communication, capture/comms.py)
for more than `DATA_WAIT_BOUND` of it, the settings of the wrapper that issued them (DDP's, FSDP's) that overlap or
shrink it, or the script's own collectives issued less often. Amdahl on the measured share, the factor assumed
(`COMM_HIDDEN`): no replay can time a collective without the job's other ranks."""

from __future__ import annotations

from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.fixes.rule import NEEDS_EDIT, Rule, register, speedup_of_part
from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.verdict import DATA_WAIT_BOUND

# Exposed communication a fix to the wrapper's settings is assumed to remove: half (bucket views and larger
# buckets, FSDP2's prefetching or keeping the parameters gathered between forward and backward, fewer syncs): an
# assumption, not a measurement, as no replay can time a collective without the job's other ranks.
COMM_HIDDEN = 2.0


def _exposed(e: Evidence) -> tuple[str, float, str] | None:
    """(why, gain, the estimate's reason) where the step waits in collectives enough to be worth a fix."""
    share = e.fractions.communication
    if share <= DATA_WAIT_BOUND or e.collectives is None:
        return None
    why = (f"{share:.0%} of each step is spent blocked in {', '.join(e.collectives.kinds) or 'collectives'} "
           "(exposed: not overlapped with compute); part of it may be the wait for a slower rank to join, which these "
           "settings do not remove (the job's report names a rank the others wait for)")
    reason = f"assumed {COMM_HIDDEN:g}x less exposed communication; {NEEDS_EDIT}, and no replay can time a collective"
    return why, speedup_of_part(share, COMM_HIDDEN), reason


@register
class DdpCommunication(Rule):
    id = "ddp_communication"
    acts_on = "collectives"
    summary = "DDP's all-reduce overlapped with backward (bucket views, larger buckets) or synced less often"

    def propose(self, e: Evidence) -> Recommendation | None:
        exposed = _exposed(e)
        if exposed is None or e.collectives is None or "ddp" not in e.collectives.wrappers:
            return None
        why, gain, reason = exposed
        view = "" if e.collectives.bucket_view else "gradient_as_bucket_view=True, "
        return Recommendation(
            "ddp_communication", "Overlap DDP's all-reduce with backward, or sync less often",
            why + ("; DDP copies the reduced gradients out of its buckets after waiting for them, which bucket views "
                   "avoid" if view else ""),
            f"DistributedDataParallel(model, {view}bucket_cap_mb=50)  # or accumulate: with model.no_sync(): "
            "for all but the last micro-batch", gain, basis_reason=reason)


@register
class FsdpCommunication(Rule):
    id = "fsdp_communication"
    acts_on = "collectives"
    summary = "FSDP's all-gathers prefetched, or the parameters kept gathered between forward and backward"

    def propose(self, e: Evidence) -> Recommendation | None:
        exposed = _exposed(e)
        if (exposed is None or e.collectives is None or "ddp" in e.collectives.wrappers
                or not {"fsdp2", "fsdp"} & set(e.collectives.wrappers)):
            return None
        why, gain, reason = exposed
        return Recommendation(
            "fsdp_communication", "Prefetch FSDP's all-gathers, or keep parameters gathered for backward",
            why + "; FSDP all-gathers each block's parameters before its forward (and again before its backward "
            "when it resharded after forward) and reduce-scatters its gradients",
            "fully_shard(block, reshard_after_forward=False)  # no all-gather in backward, more memory; or "
            "block.set_modules_to_forward_prefetch([next_block])", gain, basis_reason=reason)


@register
class FewerCollectives(Rule):
    id = "fewer_collectives"
    acts_on = "collectives"
    summary = "the script's own collectives (no DDP or FSDP wrapper issued them) issued less often"

    def propose(self, e: Evidence) -> Recommendation | None:
        exposed = _exposed(e)
        if exposed is None or e.collectives is None or {"ddp", "fsdp2", "fsdp"} & set(e.collectives.wrappers):
            return None
        why, gain, reason = exposed
        return Recommendation(
            "fewer_collectives", "Issue the script's collectives less often",
            why + "; they are the script's own (no DDP or FSDP wrapper issued them)",
            "dist.all_reduce(metric, async_op=True)  # and wait later, or reduce metrics every N steps", gain,
            basis_reason=reason)
