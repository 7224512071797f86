"""waterwave-hpo: many Optuna trials on one GPU at once.

Trials are co-hosted in one process, each on its own CUDA stream (Waterwave, IEEE Trans.
Computers 72(10), 2023). This module only re-exports the public API.
"""

from waterwave_hpo._experimental import ExperimentalWarning
from waterwave_hpo._version import __version__
from waterwave_hpo.cluster import AllHostsLostError
from waterwave_hpo.cluster import RayExecutor
from waterwave_hpo.cluster import shared_gpu
from waterwave_hpo.cluster import tune_hosts
from waterwave_hpo.executor import MemoryPoolMode
from waterwave_hpo.executor import NotInTrialError
from waterwave_hpo.executor import OnOOM
from waterwave_hpo.executor import TrialContext
from waterwave_hpo.executor import WaterwaveExecutor
from waterwave_hpo.executor import batched
from waterwave_hpo.executor import current
from waterwave_hpo.executor import current_or_none
from waterwave_hpo.executor import fit_trial_memory
from waterwave_hpo.executor import trial_memory_stats

try:
    from waterwave_hpo.integrations.optuna import Study
    from waterwave_hpo.integrations.optuna import create_study
    from waterwave_hpo.integrations.optuna import load_study
    from waterwave_hpo.integrations.optuna import wrap_study
except ModuleNotFoundError as _error:  # pragma: no cover - only in a source checkout
    if _error.name != "waterwave_hpo.integrations":
        raise
    raise ImportError(
        f"waterwave_hpo was imported from a source checkout ({__path__[0]}), where "
        "integrations/ is not inside the package and the memory pool library is not built. "
        "Install it editable (`pip install -e .` from the repository root), which works from "
        "the checkout, or install it (`pip install .`) and run from another directory "
        "(`python -m pytest` and Ray drivers started at the repository root put the checkout "
        "first on sys.path; use `pytest`)."
    ) from None
from waterwave_hpo.nodegroup import NodeGroup
from waterwave_hpo.nodegroup import node_groups
from waterwave_hpo.nodegroup import pipeline
from waterwave_hpo.planning import fit_memory
from waterwave_hpo.planning import plan_of
from waterwave_hpo.scheduler import PipelineScheduler

__all__ = [
    "AllHostsLostError",
    "ExperimentalWarning",
    "MemoryPoolMode",
    "NodeGroup",
    "NotInTrialError",
    "OnOOM",
    "PipelineScheduler",
    "RayExecutor",
    "Study",
    "TrialContext",
    "WaterwaveExecutor",
    "__version__",
    "batched",
    "create_study",
    "current",
    "current_or_none",
    "fit_memory",
    "fit_trial_memory",
    "load_study",
    "node_groups",
    "pipeline",
    "plan_of",
    "shared_gpu",
    "trial_memory_stats",
    "tune_hosts",
    "wrap_study",
]
