"""The doctor's report: built from a capture (report.py `build`), merged over a torchrun job's ranks (job.py),
verified by re-running the script with each fix (verify.py)."""
