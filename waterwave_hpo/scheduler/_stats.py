"""What the pipeline scheduler reports: ledger peak, waits per trial, deadlocks resolved."""

from __future__ import annotations

from dataclasses import dataclass
import enum


class ResolutionKind(enum.Enum):
    """How a deadlock (every running trial waiting) was resolved.

    ``ADMITTED_OUT_OF_ORDER``: a waiting request fitted the free bytes but the policy held it
    back (FIFO head-of-line, or the waterwave safety check); it was admitted anyway.
    ``EVICTED``: nothing fitted; one trial was evicted (its gate raised
    :class:`~waterwave_hpo.scheduler.BudgetExceededError`) and its bytes released.
    """

    ADMITTED_OUT_OF_ORDER = "admitted_out_of_order"
    EVICTED = "evicted"


@dataclass(frozen=True)
class DeadlockResolution:
    """One resolved deadlock.

    Attributes:
        kind: What was done.
        trial_number: The trial admitted (``ADMITTED_OUT_OF_ORDER``) or evicted (``EVICTED``).
        nbytes: Bytes that trial's pending request asked for.
        at_s: Seconds since the scheduler was created.
        waiting_trials: Every trial that was waiting, ascending.
        reason: One sentence for logs and the study's failure record.
    """

    kind: ResolutionKind
    trial_number: int
    nbytes: int
    at_s: float
    waiting_trials: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class TrialSchedulingStats:
    """One trial's dealings with the scheduler.

    Attributes:
        trial_number: The trial.
        acquires: Requests made (one per gated group per forward, plus one resident).
        waits: Requests that had to wait (not admitted at once).
        wait_s: Total seconds spent waiting in ``acquire``.
        peak_held_bytes: The most bytes the trial held at once.
        evicted: Whether it was evicted to resolve a deadlock.
        finished: Whether ``trial_finished`` was called for it.
    """

    trial_number: int
    acquires: int
    waits: int
    wait_s: float
    peak_held_bytes: int
    evicted: bool
    finished: bool


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of :meth:`PipelineScheduler.stats`.

    Attributes:
        policy: The policy's name (``"fifo"``, ``"waterwave"`` or a custom policy's).
        budget_bytes: The ledger's capacity.
        used_bytes: Bytes reserved now.
        peak_bytes: The most bytes ever reserved at once (``<= budget_bytes``, always).
        deadlocks_resolved: ``len(resolutions)``.
        evictions: Resolutions of kind ``EVICTED``.
        resolutions: Every resolved deadlock, oldest first.
        trials: Per trial, ascending trial number, running and finished.
    """

    policy: str
    budget_bytes: int
    used_bytes: int
    peak_bytes: int
    deadlocks_resolved: int
    evictions: int
    resolutions: tuple[DeadlockResolution, ...]
    trials: tuple[TrialSchedulingStats, ...]

    def trial(self, trial_number: int) -> TrialSchedulingStats:
        """The stats of ``trial_number``.

        Raises:
            KeyError: If the scheduler never saw that trial.
        """
        for t in self.trials:
            if t.trial_number == trial_number:
                return t
        raise KeyError(
            f"trial {trial_number} is not in these stats; known: "
            f"{[t.trial_number for t in self.trials]}"
        )
