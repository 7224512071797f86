"""waterwave-hpo: many Optuna trials on one GPU at once.

Trials are co-hosted in one process, each on its own CUDA stream (Waterwave, IEEE Trans.
Computers 72(10), 2023). This module only re-exports the public API.
"""

from typing import TYPE_CHECKING

import lazy_loader

if TYPE_CHECKING:  # what type checkers see; at run time each name is imported on first use
    from waterwave_hpo import bench as bench
    from waterwave_hpo import cli as cli
    from waterwave_hpo import cluster as cluster
    from waterwave_hpo import demo as demo
    from waterwave_hpo import distributed as distributed
    from waterwave_hpo import doctor as doctor
    from waterwave_hpo import executor as executor
    from waterwave_hpo import fusion as fusion
    from waterwave_hpo import host as host
    from waterwave_hpo import memory as memory
    from waterwave_hpo import nodegroup as nodegroup
    from waterwave_hpo import planning as planning
    from waterwave_hpo import relay as relay
    from waterwave_hpo import report as report
    from waterwave_hpo import scheduler as scheduler
    from waterwave_hpo import sim as sim
    from waterwave_hpo import trial as trial
    from waterwave_hpo import workers as workers
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
    import waterwave_hpo.integrations as integrations  # noqa: F401 (integrations/ in a checkout)
    from waterwave_hpo.integrations.optuna import Study
    from waterwave_hpo.integrations.optuna import create_study
    from waterwave_hpo.integrations.optuna import load_study
    from waterwave_hpo.integrations.optuna import wrap_study
    from waterwave_hpo.nodegroup import NodeGroup
    from waterwave_hpo.nodegroup import node_groups
    from waterwave_hpo.nodegroup import pipeline
    from waterwave_hpo.planning import fit_memory
    from waterwave_hpo.planning import plan_of
    from waterwave_hpo.scheduler import PipelineScheduler

# Each public name and subpackage (``ww.executor``, ``ww.planning``) is imported on its first
# use (``lazy_loader``, SPEC 1 of the Scientific Python project): ``import waterwave_hpo``
# imports no torch, so the Ray actors that need none (the storage relay, the memory broker,
# Tune's trials of a ``shared_gpu()`` search that do not train with torch) and the command
# line start without it. tests/test_package.py checks these lists against the block above.
__getattr__, __dir__, _lazy_names = lazy_loader.attach(
    __name__,
    submodules=[
        "bench",
        "cli",
        "cluster",
        "demo",
        "distributed",
        "doctor",
        "executor",
        "fusion",
        "host",
        "integrations",
        "memory",
        "nodegroup",
        "planning",
        "relay",
        "report",
        "scheduler",
        "sim",
        "trial",
        "workers",
    ],
    submod_attrs={
        "_experimental": ["ExperimentalWarning"],
        "_version": ["__version__"],
        "cluster": ["AllHostsLostError", "RayExecutor", "shared_gpu", "tune_hosts"],
        "executor": [
            "MemoryPoolMode",
            "NotInTrialError",
            "OnOOM",
            "TrialContext",
            "WaterwaveExecutor",
            "batched",
            "current",
            "current_or_none",
            "fit_trial_memory",
            "trial_memory_stats",
        ],
        "integrations.optuna": ["Study", "create_study", "load_study", "wrap_study"],
        "nodegroup": ["NodeGroup", "node_groups", "pipeline"],
        "planning": ["fit_memory", "plan_of"],
        "scheduler": ["PipelineScheduler"],
    },
)


def _check_installed() -> None:
    """Raise the source-checkout ImportError now, not at the first use of a name."""
    import importlib.util

    if importlib.util.find_spec("waterwave_hpo.integrations") is None:
        raise ImportError(
            f"waterwave_hpo was imported from a source checkout ({__path__[0]}), where "
            "integrations/ is not inside the package and the memory pool library is not "
            "built. Install it editable (`pip install -e .` from the repository root), which "
            "works from the checkout, or install it (`pip install .`) and run from another "
            "directory (`python -m pytest` and Ray drivers started at the repository root put "
            "the checkout first on sys.path; use `pytest`)."
        )


_check_installed()

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
