"""The running trial's context, below the mechanisms that read it.

NodeGroup gates, memory plans and the pool's accounts ask :func:`current_or_none` which trial
runs in their thread; the executor (one GPU) and the cluster's hosts (Ray, Tune) set it. Users
import these names as ``waterwave_hpo.current`` etc. or from ``waterwave_hpo.executor``.
"""

from waterwave_hpo.trial._context import NoOptunaTrial
from waterwave_hpo.trial._context import NotInTrialError
from waterwave_hpo.trial._context import TrialContext
from waterwave_hpo.trial._context import current
from waterwave_hpo.trial._context import current_or_none
from waterwave_hpo.trial._context import trial_scope

__all__ = [
    "NoOptunaTrial",
    "NotInTrialError",
    "TrialContext",
    "current",
    "current_or_none",
    "trial_scope",
]
