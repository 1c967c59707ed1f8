"""The regression gate on a comparison (`judge`): fail, pass, or cannot tell, by the one decision (trainfast.decide),
and the line that says which and why."""

from __future__ import annotations

from trainfast.decide import Decision, drift_bound
from trainfast.diagnose.compare.figures import STARTUP_NOISE, Comparison, Gate, Slowdown


def judge(comparison: Comparison, fail_slower_pct: float | None = None, inconclusive: str = "exit") -> Gate:
    """The regression gate (module doc) on the one decision (trainfast.decide): fail when NEW is slower than BASE by
    more than `fail_slower_pct` % (the estimate) beyond the noise (the interval clear of no change); pass when the
    interval rules out a slowdown of twice the allowance; otherwise it cannot tell, and says what would. A verdict
    that rests on a contended run, or on a whole run's start-up alone, cannot tell either. Without a threshold, only
    the line saying the change. `inconclusive`: what "cannot tell" exits (INCONCLUSIVE_CHOICES)."""
    s = comparison.slowdown
    change = _said(s)
    if fail_slower_pct is None:
        return Gate(None, True, False, f"{change}; no --fail-slower given → exit 0", inconclusive=inconclusive)
    limit = f"--fail-slower {fail_slower_pct:g} %"
    d = comparison.decision(1 + fail_slower_pct / 100)
    cannot = f"→ exit {Gate(None, False, False, '', inconclusive=inconclusive).exit_code}"

    def gate(decided: bool, failed: bool, verdict: str) -> Gate:
        return Gate(fail_slower_pct, decided, failed, verdict, d, inconclusive)
    base_busy, new_busy = comparison.contended
    if d.slower:
        if new_busy:  # the slowdown may be the other processes'
            return gate(False, False, f"warning: cannot tell: {change}, more than {limit}, but NEW was measured "
                                      f"while {new_busy}: the slowdown may be theirs; rerun NEW on a quiet machine "
                                      f"{cannot}")
        w, startup = comparison.without_startup, comparison.startup
        if w is not None and w.low_pct <= fail_slower_pct and startup is not None and \
                startup[1] <= startup[0] * (1 + STARTUP_NOISE):  # one figure a run: no spread to judge it by
            return gate(False, False, f"warning: cannot tell: {change}, more than {limit}, but with BASE's start-up "
                                      f"it would be {_signed(w)}: the difference is the start-up "
                                      f"({_startup_change(comparison)}), one figure per run, which varies by up to "
                                      f"{STARTUP_NOISE:.0%} between runs of the same script; rerun both {cannot}")
        return gate(True, True, f"{change}: more than {limit} → exit 1")
    if d.low > 1 / (1 + 2 * fail_slower_pct / 100):
        if base_busy:  # a yardstick slowed by other processes can hide a slowdown
            return gate(False, False, f"warning: cannot tell: {change}, but BASE was measured while {base_busy}: a "
                                      f"slowed baseline can hide a slowdown; remeasure BASE on a quiet machine "
                                      f"{cannot}")
        return gate(True, False, f"{change}: not more than {limit}, and a slowdown of twice that is ruled out → "
                                 "exit 0")
    return gate(False, False, f"warning: cannot tell: {change}: {_doubt(comparison, d, fail_slower_pct)} {cannot}")


def _doubt(comparison: Comparison, d: Decision, pct: float) -> str:
    """Why the runs cannot tell, and what would: the smallest change they could detect, the runs that would."""
    runs = comparison.runs
    detectable = f"these runs could detect a change of {(d.detectable - 1) * 100:.0f} % or more"
    if runs == (1, 1):
        why = (f"one run a side cannot show the spread between runs (here up to {(drift_bound() - 1) * 100:.0f} %), "
               f"so {detectable}")
    else:
        aside = f", {d.set_aside} set aside as stalled" if d.set_aside else ""
        why = f"{detectable} ({d.pairs} {'pairs' if comparison.paired else 'runs a side'}{aside}, spread {d.sd:.1%})"
    more = (f"about {d.pairs_needed} runs a side would tell a {pct:g} % change at this noise"
            if d.pairs_needed else f"no affordable number of runs tells a {pct:g} % change at this noise")
    return f"{why}; {more} (--runs N, --max-runs, or more reports a side), or raise --fail-slower"


def _signed(s: Slowdown, per: str = "") -> str:
    """"6.1 % slower (interval 2.0–9.9 %)" or "1.2 % faster (slowdown interval -3.0 to +0.7 %)"."""
    interval = (f"{s.low_pct:.1f}–{s.high_pct:.1f} %" if s.low_pct >= 0
                else f"{s.low_pct:+.1f} to {s.high_pct:+.1f} %")
    return f"{s.pct:.1f} % slower{per} (interval {interval})" if s.pct >= 0 else \
        f"{-s.pct:.1f} % faster{per} (slowdown interval {interval})"


def _startup_change(comparison: Comparison) -> str:
    """"startup 2.10 → 2.61 s"."""
    phase = next((c for c in comparison.phases if c.name == "startup"), None)
    return f"startup {phase.base or 0.0:.2f} → {phase.new or 0.0:.2f} s" if phase else "startup"


def _said(s: Slowdown) -> str:
    """"NEW is 17.2 % slower (interval 14.1–20.3 %)", or "faster" (interval of the slowdown, signed)."""
    return "NEW is " + _signed(s, " in wall time per sample" if s.measure == "wall time per sample" else "")
