"""The search's time budget: a pruner that stops every trial, and the study, at its end."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from optuna.pruners import BasePruner

if TYPE_CHECKING:
    import optuna


class DeadlinePruner(BasePruner):
    """``base``'s decision, and ``True`` for every trial once the wall clock passes a deadline.

    A search's ``timeout`` only stops it from starting trials; the ones running at the
    deadline would finish and overrun the budget. With this pruner they end PRUNED at their
    next report (the demo's objective reports every epoch), so a search stays within its
    budget plus one epoch. Trials that end after the deadline do not count toward the search's
    result at its budget anyway.

    Picklable (workers of ``isolation="process"`` ask it in their own process): the deadline
    is wall-clock seconds since the epoch, the same in every process of the machine.

    Args:
        base: The search's own pruner.
        deadline_s: ``time.time()`` after which every trial is pruned; ``math.inf``: never
            (set it with :meth:`start` when the search starts).
    """

    def __init__(self, base: BasePruner, deadline_s: float = math.inf) -> None:
        self.base = base
        self.deadline_s = deadline_s

    def start(self, budget_s: float) -> float:
        """Set the deadline ``budget_s`` seconds from now; returns now (``time.time()``)."""
        now = time.time()
        self.deadline_s = now + budget_s
        return now

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        """Whether to stop ``trial``: past the deadline, or ``base`` says so."""
        if time.time() >= self.deadline_s:
            return True
        return bool(self.base.prune(study, trial))

    def stop_study(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        """A callback for ``optimize``: past the deadline, ``study.stop()``, so no trial starts.

        ``timeout`` alone may start trials after the deadline: the executor counts it from
        when its hosts are ready (with worker processes, after they took the objective), not
        from the ``optimize`` call.
        """
        if time.time() >= self.deadline_s:
            study.stop()
