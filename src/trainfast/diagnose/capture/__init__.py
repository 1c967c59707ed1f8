"""The doctor's first stage: the hooks that watch an unmodified training loop, the script run under them, the
candidate fixes timed on its model, and the run frozen into a `Capture` (instrument.py `Instrumentation.snapshot`)."""
