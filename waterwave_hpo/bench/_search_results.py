"""What one search did (its trials on its own clock), and what it found by its budget."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field
from typing import Any


@dataclass(frozen=True)
class TrialOutcome:
    """One trial of a search, on the search's clock.

    Attributes:
        number: The trial's number in its study.
        state: ``COMPLETE``, ``PRUNED``, ``FAIL`` (or ``RUNNING``/``WAITING`` if it never
            ended).
        value: Its validation accuracy (COMPLETE), else ``None``.
        start_s: Seconds from the search's start to the trial's start; ``None`` if unknown.
        end_s: Seconds from the search's start to when its ending was told to the study;
            ``None`` if it never ended.
        params: Its parameters.
    """

    number: int
    state: str
    value: float | None
    start_s: float | None
    end_s: float | None
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class SearchRun:
    """One search: one method, one seed, measured from its first ask.

    Attributes:
        method: The :class:`SearchMethod` value.
        seed: Seeds the sampler and the trials' torch generators.
        k: Trials at once (1 for one at a time; for fused, trials per fused model).
        budget_s: The search's time budget, seconds: no trial starts after it, running ones
            are pruned at their next epoch, and only trials that ended by it count.
        available: Whether it ran; if not, ``skipped_reason`` says why.
        skipped_reason: Why it did not run on this machine ("" when it ran).
        torch_threads: torch's intra-op threads per trial (per process).
        startup_s: Seconds spent before the search's clock started: making the executor and,
            with ``isolation="process"``, starting its workers (they serve the whole search).
        wall_s: Seconds from the first ask to the search's end (past ``budget_s`` by the
            trials that ran on to their next epoch).
        load_average_1min: The machine's 1-minute load average when the search started.
        trials: Every trial of the study.
    """

    method: str
    seed: int
    k: int
    budget_s: float
    available: bool = True
    skipped_reason: str = ""
    torch_threads: int = 0
    startup_s: float = 0.0
    wall_s: float = 0.0
    load_average_1min: float | None = None
    trials: list[TrialOutcome] = field(default_factory=list)

    def in_budget(self, state: str) -> list[TrialOutcome]:
        """The trials of ``state`` that ended within the budget."""
        return [
            t
            for t in self.trials
            if t.state == state and t.end_s is not None and t.end_s <= self.budget_s
        ]

    def trajectory(self) -> list[tuple[float, float]]:
        """Best-so-far validation accuracy: ``(seconds, best)`` at each improvement.

        Counts the COMPLETE trials that ended within the budget, in the order they ended.
        """
        points: list[tuple[float, float]] = []
        done = sorted(self.in_budget("COMPLETE"), key=lambda t: (t.end_s, t.number))
        for trial in done:
            assert trial.end_s is not None and trial.value is not None
            if not points or trial.value > points[-1][1]:
                points.append((trial.end_s, trial.value))
        return points

    def best_value_at_budget(self) -> float | None:
        """The best validation accuracy of a trial that completed within the budget."""
        points = self.trajectory()
        return points[-1][1] if points else None

    def time_to(self, target: float) -> float | None:
        """Seconds until the best-so-far accuracy first reached ``target``; ``None`` if never."""
        return time_to_target(self.trajectory(), target)


def time_to_target(trajectory: list[tuple[float, float]], target: float) -> float | None:
    """The first time in ``trajectory`` (``(seconds, best)``, in time order) with best >= target.

    Returns:
        Seconds, or ``None`` if the trajectory never reaches ``target``.
    """
    for seconds, best in trajectory:
        if best >= target:
            return seconds
    return None


@dataclass(frozen=True)
class Target:
    """The accuracy a search must reach: a fraction of the best any run of the bench found.

    Attributes:
        fraction: The fraction, in (0, 1].
        best_any_run: The best validation accuracy any search found within its budget.
        value: ``fraction * best_any_run``.
    """

    fraction: float
    best_any_run: float | None
    value: float | None

    @staticmethod
    def of(runs: list[SearchRun], fraction: float) -> Target:
        """``fraction`` of the best value any run of ``runs`` found within its budget."""
        bests = [
            b for b in (r.best_value_at_budget() for r in runs if r.available) if b is not None
        ]
        best = max(bests) if bests else None
        return Target(fraction, best, None if best is None else fraction * best)

    def describe(self) -> str:
        """The target in words, for the results."""
        if self.value is None:
            return "none: no search completed a trial within its budget"
        return (
            f"{self.fraction:.0%} of the best validation accuracy any search found within its "
            f"budget ({self.best_any_run:.4f}): {self.value:.4f}"
        )
