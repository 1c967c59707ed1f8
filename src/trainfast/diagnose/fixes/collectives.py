"""The collectives' fixes: where the step waits in collectives across ranks (exposed communication, capture/comms.py)
for more than `DATA_WAIT_BOUND` of it, the settings of the wrapper that issued them (DDP's, FSDP's) that overlap or
shrink it, or the script's own collectives issued less often. No gain is assumed: FSDP2's is measured on the job's
own steps, every rank alike (capture/comm_trial.py); DDP's bucket settings are fixed when DDP is built, and the
script's own collectives need an edit, so those two are named with no gain, and say why."""

from __future__ import annotations

from trainfast.diagnose.capture.comm_trial import TRIAL_ID
from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.fixes.rule import MIN_GAIN, NEEDS_EDIT, Rule, register
from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.records.trials import Trial
from trainfast.diagnose.verdict import DATA_WAIT_BOUND

# Why DDP's settings have no gain: they cannot be changed in the running job, and no copy can run without its ranks
DDP_FIXED = ("DDP's bucket settings are fixed when it is built, so the doctor cannot switch them in the running job "
             "to time them, and no replay can time a collective without the job's other ranks")


def _exposed(e: Evidence) -> str | None:
    """Why the fix is worth naming, where the step waits in collectives for more than `DATA_WAIT_BOUND` of it."""
    share = e.fractions.communication
    if share <= DATA_WAIT_BOUND or e.collectives is None:
        return None
    return (f"{share:.0%} of each step is spent blocked in {', '.join(e.collectives.kinds) or 'collectives'} "
            "(exposed: not overlapped with compute); part of it may be the wait for a slower rank to join, which these "
            "settings do not remove (the job's report names a rank the others wait for)")


@register
class DdpCommunication(Rule):
    id = "ddp_communication"
    acts_on = "collectives"
    summary = "DDP's all-reduce overlapped with backward (bucket views, larger buckets) or synced less often"

    def propose(self, e: Evidence) -> Recommendation | None:
        why = _exposed(e)
        if why is None or e.collectives is None or "ddp" not in e.collectives.wrappers:
            return None
        view = "" if e.collectives.bucket_view else "gradient_as_bucket_view=True, "
        return Recommendation(
            "ddp_communication", "Overlap DDP's all-reduce with backward, or sync less often",
            why + ("; DDP copies the reduced gradients out of its buckets after waiting for them, which bucket views "
                   "avoid" if view else ""),
            f"DistributedDataParallel(model, {view}bucket_cap_mb=50)  # or accumulate: with model.no_sync(): "
            "for all but the last micro-batch", None, basis_reason=DDP_FIXED)


def _decided(trial: Trial) -> str:
    """"1.31x as fast (1.12-1.53x, 96 %, 12 pairs of adjacent steps; 10 faster: faster"."""
    d = trial.decision
    assert d is not None and trial.factor is not None
    return (f"{trial.factor:.2f}x as fast ({d.low:.2f}-{d.high:.2f}x, {d.confidence:.0%}, {trial.rounds} pairs of "
            f"adjacent steps, {trial.faster_rounds} faster; {d.verdict}")


@register
class FsdpCommunication(Rule):
    id = "fsdp_communication"
    acts_on = "collectives"
    summary = "FSDP's all-gathers prefetched, or the parameters kept gathered between forward and backward"

    def propose(self, e: Evidence) -> Recommendation | None:
        wrappers = set(e.collectives.wrappers) if e.collectives is not None else set()
        if "ddp" in wrappers or not {"fsdp2", "fsdp"} & wrappers:
            return None
        trial = e.trials.get(TRIAL_ID) if e.trials is not None else None
        factor = trial.factor if trial is not None else None
        measured = trial is not None and trial.faster and factor is not None and factor >= MIN_GAIN
        why = _exposed(e)
        if why is None and not measured:
            return None
        what = "FSDP all-gathers each block's parameters before its forward (and again before its backward when it " \
               "resharded after forward) and reduce-scatters its gradients"
        fix = ("fully_shard(block, reshard_after_forward=False)  # no all-gather in backward, more memory; or "
               "block.set_modules_to_forward_prefetch([next_block])")
        title = "Prefetch FSDP's all-gathers, or keep parameters gathered for backward"
        if measured:
            assert trial is not None and factor is not None
            return Recommendation(
                "fsdp_communication", "Keep FSDP's parameters gathered from forward to backward",
                (why + "; " if why else "") + f"{what}; with the parameters kept gathered the job's own steps ran "
                f"{_decided(trial)}, every rank switching at the same step)", fix, factor,
                gain_basis="measured")
        if trial is not None and trial.factor is not None:
            reason = (f"measured: keeping the parameters gathered ran the job's steps {_decided(trial)}): no gain "
                      f"shown; prefetching is not timed ({NEEDS_EDIT})")
        elif trial is not None:
            reason = f"not measured: {trial.reason}"
        else:
            reason = "not measured: no FSDP2 module that reshards after forward was seen to switch"
        return Recommendation("fsdp_communication", title, f"{why}; {what}", fix, None, basis_reason=reason)


@register
class FewerCollectives(Rule):
    id = "fewer_collectives"
    acts_on = "collectives"
    summary = "the script's own collectives (no DDP or FSDP wrapper issued them) issued less often"

    def propose(self, e: Evidence) -> Recommendation | None:
        why = _exposed(e)
        if why is None or e.collectives is None or {"ddp", "fsdp2", "fsdp"} & set(e.collectives.wrappers):
            return None
        return Recommendation(
            "fewer_collectives", "Issue the script's collectives less often",
            why + "; they are the script's own (no DDP or FSDP wrapper issued them)",
            "dist.all_reduce(metric, async_op=True)  # and wait later, or reduce metrics every N steps", None,
            basis_reason=f"{NEEDS_EDIT}, and no replay can time a collective without the job's other ranks")
