"""The doctor's evidence: what a run's `Capture` says, computed from it alone (evidence.py `evidence_of`)."""
