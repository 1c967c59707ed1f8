"""How a report looks, one table each for the terminal and the HTML page alike: each verdict's colour, each part of
a step (its label and colour, in the order the reports show them), each phase of a whole run."""

from __future__ import annotations

from trainfast.trainer.phases import PHASES

# verdict -> (the terminal's style, the page's colour)
VERDICTS = {"input-bound": ("bold red", "#c92a2a"), "transfer-bound": ("bold red", "#a61e8c"),
            "host-bound": ("bold yellow", "#c26a00"), "communication-bound": ("bold magenta", "#0b7285"),
            "compute-bound": ("bold green", "#2b8a3e"), "balanced": ("bold cyan", "#1864ab")}
NO_VERDICT = ("bold", "#5c6370")
# the parts of a step, in the order shown: (its share's key in "fractions", its key in a "timeline" row, label,
# the terminal's colour, the page's colour); the page shows no collection phase
PARTS = (("data_wait", "wait_s", "data wait", "red", "#e5484d"),
         ("transfer", "transfer_s", "transfer", "magenta", "#c026d3"),
         ("host", "host_s", "host", "yellow", "#f59f00"),
         ("collection", "collect_s", "rollout / host work between updates", "blue", None),
         ("communication", "comm_s", "communication", "cyan", "#0b7285"),
         ("compute", "compute_s", "compute", "green", "#2f9e44"))
# a whole run's phase -> (the terminal's colour, the page's colour)
PHASE_COLOURS = dict(zip(PHASES, (("blue", "#1c7ed6"), ("magenta", "#c026d3"), ("green", "#2f9e44"),
                                  ("cyan", "#0ca678"), ("yellow", "#f59f00"), ("red", "#e5484d"),
                                  ("white", "#868e96")), strict=True))
