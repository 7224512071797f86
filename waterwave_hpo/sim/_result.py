"""What a simulation returns: per attempt, per trial, and for the device."""

from __future__ import annotations

from dataclasses import dataclass
import enum


class AttemptOutcome(enum.Enum):
    """How one attempt of a trial ended."""

    COMPLETE = "complete"
    OOM = "oom"
    """An allocation did not fit the device (no ledger: the stock allocator's OOM)."""
    EVICTED = "evicted"
    """The pipeline scheduler evicted it to resolve a deadlock (``BudgetExceededError``)."""


@dataclass(frozen=True)
class SimAttempt:
    """One run of one trial.

    Attributes:
        trial_index: Index of the trial in the list given to ``simulate``.
        attempt: ``0`` first, ``k`` for the ``k``-th re-run after an OOM or eviction.
        start_s: Seconds from the simulation's start.
        end_s: Seconds from the simulation's start.
        outcome: How it ended.
        peak_held_bytes: The most bytes it held at once.
        slot: The slot it ran in (``0 <= slot < concurrency``), for Gantt charts.
    """

    trial_index: int
    attempt: int
    start_s: float
    end_s: float
    outcome: AttemptOutcome
    peak_held_bytes: int
    slot: int


@dataclass(frozen=True)
class SimResult:
    """The simulated run.

    Attributes:
        makespan_s: Seconds until the last trial ended.
        attempts: Every attempt, in the order they ended.
        n_complete: Trials that completed.
        n_failed: Trials that ended failed (out of retries, or retries off).
        ooms: Attempts that ended in an out-of-memory error.
        evictions: Attempts the scheduler evicted.
        peak_bytes: The most bytes in use on the device at once.
        max_concurrent: The most trials running at once.
        memory_timeline: ``(seconds, bytes in use)`` after every change.
        n_planned: Attempts that ran with a memory plan (``Sharing(memory_plans=True)``).
    """

    makespan_s: float
    attempts: tuple[SimAttempt, ...]
    n_complete: int
    n_failed: int
    ooms: int
    evictions: int
    peak_bytes: int
    max_concurrent: int
    memory_timeline: tuple[tuple[float, int], ...]
    n_planned: int = 0
