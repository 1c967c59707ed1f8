"""The doctor's run: the stages wired together (doctor.py), the library's entry points (library.py) and the child
process `--verify` starts (child.py)."""

from trainfast.diagnose.run.doctor import DEFAULT_MAX_SECONDS, DoctorRun, build_report, run_doctor
from trainfast.diagnose.run.library import Doctor, diagnose

__all__ = ["DEFAULT_MAX_SECONDS", "Doctor", "DoctorRun", "build_report", "diagnose", "run_doctor"]
