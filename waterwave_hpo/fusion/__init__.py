"""Fusion: K trials of one structure trained as one model (HFTA, arXiv:2102.02344).

``fusion.optimizer`` builds a :class:`FusedOptimizer` whose every hyperparameter is per model;
``PerModelScheduler`` and ``LambdaLR`` give each model its own learning-rate schedule.
"""

from __future__ import annotations

from waterwave_hpo.fusion._optim import FusedOptimizer
from waterwave_hpo.fusion._optim import OptimizerKind
from waterwave_hpo.fusion._optim import optimizer
from waterwave_hpo.fusion._schedule import LambdaLR
from waterwave_hpo.fusion._schedule import PerModelScheduler

__all__ = [
    "FusedOptimizer",
    "LambdaLR",
    "OptimizerKind",
    "PerModelScheduler",
    "optimizer",
]
