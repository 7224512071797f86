"""``waterwave-hpo doctor``: prove an installation right on the user's own machine.

Versions, the pool library, then acceptance checks on the real GPU (or, without one, on the
simulated device), each PASS/FAIL/SKIP with its figure, written as a JSON report a user can
attach to a bug report. This module only re-exports.
"""

from __future__ import annotations

from waterwave_hpo.doctor._report import CheckResult
from waterwave_hpo.doctor._report import CheckStatus
from waterwave_hpo.doctor._report import DoctorReport
from waterwave_hpo.doctor._report import check_report_path
from waterwave_hpo.doctor._run import run_doctor

__all__ = ["CheckResult", "CheckStatus", "DoctorReport", "check_report_path", "run_doctor"]
