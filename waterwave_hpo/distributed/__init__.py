"""Data-parallel trials with sparse gradient communication (LaySA, IEEE Access 2021).

A DDP communication hook doing per-layer top-k with error feedback and layer-centric buffer
reuse, the mirror weight update, and the baselines it is measured against. This module only
re-exports.
"""

from waterwave_hpo.distributed._attach import LaySA
from waterwave_hpo.distributed._attach import laysa
from waterwave_hpo.distributed._baselines import Baseline
from waterwave_hpo.distributed._baselines import NaiveTopKState
from waterwave_hpo.distributed._baselines import attach_baseline
from waterwave_hpo.distributed._baselines import naive_topk_hook
from waterwave_hpo.distributed._hook import laysa_hook
from waterwave_hpo.distributed._ledger import CommMemoryLedger
from waterwave_hpo.distributed._state import LaySAState

__all__ = [
    "Baseline",
    "CommMemoryLedger",
    "LaySA",
    "LaySAState",
    "NaiveTopKState",
    "attach_baseline",
    "laysa",
    "laysa_hook",
    "naive_topk_hook",
]
