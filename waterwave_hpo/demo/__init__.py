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
from waterwave_hpo.demo._journal import JournalDamagedError
from waterwave_hpo.demo._journal import check_journal
from waterwave_hpo.demo._journal import open_journal
from waterwave_hpo.demo._liveness import LivenessRule
from waterwave_hpo.demo._lock import HolderNamingJournalFileLock
from waterwave_hpo.demo._model import SeededDropout
from waterwave_hpo.demo._model import build_model
from waterwave_hpo.demo._objective import make_objective
from waterwave_hpo.demo._run import DEMO_FILES
from waterwave_hpo.demo._run import DemoConfig
from waterwave_hpo.demo._run import DemoResult
from waterwave_hpo.demo._run import DemoSettingError
from waterwave_hpo.demo._run import run_demo

__all__ = [
    "DEMO_FILES",
    "DemoConfig",
    "DemoResult",
    "DemoSettingError",
    "Digits",
    "FixedModel",
    "HolderNamingJournalFileLock",
    "JournalDamagedError",
    "LivenessRule",
    "SeededDropout",
    "build_fixed_model",
    "build_model",
    "check_journal",
    "load_digits",
    "make_fused_objective",
    "make_objective",
    "make_unfused_objective",
    "open_journal",
    "run_demo",
    "suggest_numbers",
]
