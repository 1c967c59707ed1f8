"""The fixes: one registered rule per fix (rule.py), by what they act on: the loader's workers (workers.py), the rest
of the input pipeline (input.py), the model step's precision (precision.py) and the rest of it (model.py), the
collectives across ranks (collectives.py), the whole run's phases (run.py). Imported here in that order, which is the
order of `RULES` and breaks ranking ties."""

from trainfast.diagnose.fixes import workers  # noqa: I001, F401 (each import registers its rules, in this order)
from trainfast.diagnose.fixes import input  # noqa: F401
from trainfast.diagnose.fixes import precision  # noqa: F401
from trainfast.diagnose.fixes import model  # noqa: F401
from trainfast.diagnose.fixes import collectives  # noqa: F401
from trainfast.diagnose.fixes import run  # noqa: F401
from trainfast.diagnose.fixes.rule import RULES, Rule, rank, recommend

__all__ = ["RULES", "Rule", "rank", "recommend"]
