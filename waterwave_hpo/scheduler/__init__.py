"""The pipeline scheduler: a memory ledger per device and policies that order NodeGroup requests.

See :class:`PipelineScheduler` for the interface the executor and the gates call.
"""

from __future__ import annotations

from waterwave_hpo.scheduler._errors import BudgetExceededError
from waterwave_hpo.scheduler._ledger import MemoryLedger
from waterwave_hpo.scheduler._ledger import Phase
from waterwave_hpo.scheduler._ledger import Reservation
from waterwave_hpo.scheduler._policy import FifoPolicy
from waterwave_hpo.scheduler._policy import LedgerView
from waterwave_hpo.scheduler._policy import Policy
from waterwave_hpo.scheduler._policy import PolicyName
from waterwave_hpo.scheduler._policy import Request
from waterwave_hpo.scheduler._policy import TrialView
from waterwave_hpo.scheduler._policy import WaterwavePolicy
from waterwave_hpo.scheduler._policy import make_policy
from waterwave_hpo.scheduler._scheduler import PipelineScheduler
from waterwave_hpo.scheduler._stats import DeadlockResolution
from waterwave_hpo.scheduler._stats import ResolutionKind
from waterwave_hpo.scheduler._stats import SchedulerStats
from waterwave_hpo.scheduler._stats import TrialSchedulingStats
from waterwave_hpo.scheduler._trial_profile import TrialProfile

__all__ = [
    "BudgetExceededError",
    "DeadlockResolution",
    "FifoPolicy",
    "LedgerView",
    "MemoryLedger",
    "Phase",
    "PipelineScheduler",
    "Policy",
    "PolicyName",
    "Request",
    "Reservation",
    "ResolutionKind",
    "SchedulerStats",
    "TrialProfile",
    "TrialSchedulingStats",
    "TrialView",
    "WaterwavePolicy",
    "make_policy",
]
