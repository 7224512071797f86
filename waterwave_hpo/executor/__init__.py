"""The executor: co-hosted trials, one thread and one CUDA stream each, on every device."""

from waterwave_hpo.executor._executor import WaterwaveExecutor
from waterwave_hpo.executor._isolation import Isolation
from waterwave_hpo.executor._storage_errors import StorageWriteError
from waterwave_hpo.host import BatchedObjective
from waterwave_hpo.host import MemoryPlanMode
from waterwave_hpo.host import MemoryPoolMode
from waterwave_hpo.host import NoPlanFitsError
from waterwave_hpo.host import OnOOM
from waterwave_hpo.host import TrialInterrupted
from waterwave_hpo.host import UnpicklableError
from waterwave_hpo.host import batched
from waterwave_hpo.host import fit_trial_memory
from waterwave_hpo.host import is_out_of_memory
from waterwave_hpo.host import trial_attr
from waterwave_hpo.host import trial_memory_plan
from waterwave_hpo.host import trial_memory_stats
from waterwave_hpo.trial import NotInTrialError
from waterwave_hpo.trial import TrialContext
from waterwave_hpo.trial import current
from waterwave_hpo.trial import current_or_none
from waterwave_hpo.trial import trial_scope

__all__ = [
    "BatchedObjective",
    "Isolation",
    "MemoryPlanMode",
    "MemoryPoolMode",
    "NoPlanFitsError",
    "NotInTrialError",
    "OnOOM",
    "StorageWriteError",
    "TrialContext",
    "TrialInterrupted",
    "UnpicklableError",
    "WaterwaveExecutor",
    "batched",
    "current",
    "current_or_none",
    "fit_trial_memory",
    "is_out_of_memory",
    "trial_attr",
    "trial_memory_plan",
    "trial_memory_stats",
    "trial_scope",
]
