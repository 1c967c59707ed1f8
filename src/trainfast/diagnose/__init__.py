"""The doctor: measure where a training step's time goes, give a verdict with numbers and ranked fixes."""

from trainfast.diagnose.fixes import recommend
from trainfast.diagnose.records.findings import Recommendation, Verdict
from trainfast.diagnose.records.steps import Fractions
from trainfast.diagnose.report.report import Report
from trainfast.diagnose.run import Doctor, DoctorRun, diagnose, run_doctor
from trainfast.diagnose.show import terminal as _terminal
from trainfast.diagnose.verdict import VERDICTS, classify

__all__ = ["VERDICTS", "Doctor", "DoctorRun", "Fractions", "Recommendation", "Report", "Verdict", "classify",
           "diagnose", "recommend", "run_doctor"]

# report.render()'s terminal view: the report stage comes before the display and imports none of it
Report.renderer = _terminal.render_terminal
