"""The demo: a NAS + HPO search of small CNNs on scikit-learn's handwritten digits.

``waterwave-hpo demo`` runs it from the command line; :func:`run_demo` from Python.
"""

from waterwave_hpo.demo._data import Digits
from waterwave_hpo.demo._data import load_digits
from waterwave_hpo.demo._fused import FixedModel
from waterwave_hpo.demo._fused import build_fixed_model
from waterwave_hpo.demo._fused import make_fused_objective
from waterwave_hpo.demo._fused import make_unfused_objective
from waterwave_hpo.demo._fused import suggest_numbers
from waterwave_hpo.demo._fused_nas import PER_MODEL_PARAMS
from waterwave_hpo.demo._fused_nas import make_fused_nas_objective
from waterwave_hpo.demo._fused_nas import nas_pinning_sampler
from waterwave_hpo.demo._journal import JournalDamagedError
from waterwave_hpo.demo._journal import check_journal
from waterwave_hpo.demo._journal import open_journal
from waterwave_hpo.demo._liveness import LivenessRule
from waterwave_hpo.demo._lock import HolderNamingJournalFileLock
from waterwave_hpo.demo._model import SeededDropout
from waterwave_hpo.demo._model import build_model
from waterwave_hpo.demo._model import suggest_batch_size
from waterwave_hpo.demo._model import suggest_optimizer
from waterwave_hpo.demo._objective import make_objective
from waterwave_hpo.demo._pinning import StructurePinningSampler
from waterwave_hpo.demo._run import DEMO_FILES
from waterwave_hpo.demo._run import DemoConfig
from waterwave_hpo.demo._run import DemoResult
from waterwave_hpo.demo._run import DemoSettingError
from waterwave_hpo.demo._run import run_demo
from waterwave_hpo.demo._study import demo_pruner
from waterwave_hpo.demo._study import demo_sampler

__all__ = [
    "DEMO_FILES",
    "PER_MODEL_PARAMS",
    "DemoConfig",
    "DemoResult",
    "DemoSettingError",
    "Digits",
    "FixedModel",
    "HolderNamingJournalFileLock",
    "JournalDamagedError",
    "LivenessRule",
    "SeededDropout",
    "StructurePinningSampler",
    "build_fixed_model",
    "build_model",
    "check_journal",
    "demo_pruner",
    "demo_sampler",
    "load_digits",
    "make_fused_nas_objective",
    "make_fused_objective",
    "make_objective",
    "make_unfused_objective",
    "nas_pinning_sampler",
    "open_journal",
    "run_demo",
    "suggest_batch_size",
    "suggest_numbers",
    "suggest_optimizer",
]
