"""The doctor: measure where a training step's time goes, give a verdict with numbers and ranked fixes."""

from trainfast.diagnose.api import Doctor, diagnose
from trainfast.diagnose.classify import VERDICTS, Fractions, Verdict, classify
from trainfast.diagnose.recommend import recommend
from trainfast.diagnose.recommendation import Recommendation
from trainfast.diagnose.report import Report
from trainfast.diagnose.runner import DoctorRun, run_doctor

__all__ = ["VERDICTS", "Doctor", "DoctorRun", "Fractions", "Recommendation", "Report", "Verdict", "classify",
           "diagnose", "recommend", "run_doctor"]
