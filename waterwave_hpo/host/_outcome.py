"""How one run of a trial ended, as the slot thread reports it to the executor."""

from __future__ import annotations

from dataclasses import dataclass
import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial

    from waterwave_hpo.host._planning import TrialPlanning


class OnOOM(str, enum.Enum):
    """What the executor does with a trial that runs out of device memory.

    ``RETRY``: the attempt is told FAIL (with the reason in its system attributes on request) and
    the same parameters are enqueued again (``study.enqueue_trial``) to run with fewer neighbours
    on the device, up to ``max_oom_retries`` times. ``FAIL``: the trial is told FAIL. Either way
    its neighbours go on.
    """

    RETRY = "retry"
    FAIL = "fail"


class OutcomeKind(enum.Enum):
    """How a trial attempt ended, from the executor's point of view."""

    COMPLETE = "complete"
    """The objective returned; the study was told (it may still mark an invalid value FAIL)."""
    PRUNED = "pruned"
    """The objective raised ``optuna.TrialPruned``."""
    FAILED = "failed"
    """The objective raised an exception listed in ``catch``; the others go on."""
    OOM_FAILED = "oom_failed"
    """Out of device memory, and no retry is left (or it was alone on the device)."""
    OOM_RETRY = "oom_retry"
    """Out of device memory; the executor enqueues the same parameters again."""
    FATAL = "fatal"
    """An exception not in ``catch``: the trial is told FAIL and ``optimize`` re-raises it."""
    INTERRUPTED = "interrupted"
    """The executor stopped the trial (Ctrl+C); it was told FAIL by the executor."""
    HOST_LOST = "host_lost"
    """The device host running the trial died (a Ray host actor killed, its node lost); the
    trial was told FAIL and the executor enqueues the same parameters again on another host."""


@dataclass
class TrialJob:
    """A trial handed to a slot: the Optuna trial and which attempt of its parameters it is."""

    trial: optuna.trial.Trial
    attempt: int = 0
    retry_of: int | None = None
    planning: TrialPlanning | None = None
    """Its memory planning (``memory_plan="home"``), filled in by its thread; else ``None``."""
    batch: tuple[TrialJob, ...] = ()
    """A fused batch (``WaterwaveExecutor(fuse=K)``): the jobs of its trials, each reported
    with its own outcome; :attr:`trial` is then the first one's. Empty for one trial."""

    def members(self) -> tuple[TrialJob, ...]:
        """The one-trial jobs this job runs: its batch, or itself."""
        return self.batch or (self,)


@dataclass
class TrialOutcome:
    """What a slot reports back after running a :class:`TrialJob`."""

    job: TrialJob
    kind: OutcomeKind
    frozen_trial: FrozenTrial | None
    error: BaseException | None = None
    neighbours: int = 0
    """Trials running beside this one on its device when it ended (used by OOM retries)."""
    fail_message: str | None = None
    """Why the study marked a returned value FAIL (not a number, wrong count), else ``None``."""
