"""When trainfast's import began, and what `import torch` took of it.

`doctor --whole-run` counts the rest of its own start-up (its modules, rich, psutil: ~0.3 s on 2 CPUs) as the
doctor's time, not the script's start-up: the script imports torch anyway (and finds it imported), not the rest.
"""

import time

STARTED = time.perf_counter()
import torch  # noqa: E402,F401  (imported here, first, to be timed apart from the rest)

TORCH_S = time.perf_counter() - STARTED
