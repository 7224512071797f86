"""Errors raised by the pipeline scheduler to a trial's NodeGroup gate."""

from __future__ import annotations


class BudgetExceededError(RuntimeError):
    """A trial's memory request cannot be served within the device's memory budget.

    Raised in the trial's own thread, by the NodeGroup gate blocked in
    :meth:`~waterwave_hpo.scheduler.PipelineScheduler.acquire`, when either

    * the request can never fit: what the trial already holds plus ``nbytes`` exceeds the
      whole budget, even with no other trial on the device; or
    * every running trial was blocked, no request could be admitted, and the scheduler chose
      this trial as the victim to break the deadlock (its reservations are released when the
      executor calls ``trial_finished`` for it; the other trials wait for that).

    The executor treats it like a CUDA out-of-memory error of this trial alone: fail it, or
    re-queue it with fewer neighbours. Nothing else on the device is affected.

    Attributes:
        trial_number: The trial that asked.
        nbytes: Bytes it asked for (one NodeGroup's reservation).
        held_bytes: Bytes it held when the error was raised.
        budget_bytes: The scheduler's budget.
        evicted: ``True`` when chosen as a deadlock victim, ``False`` when the request
            alone exceeds the budget.
    """

    def __init__(
        self,
        trial_number: int,
        nbytes: int,
        held_bytes: int,
        budget_bytes: int,
        *,
        evicted: bool,
    ) -> None:
        self.trial_number = trial_number
        self.nbytes = nbytes
        self.held_bytes = held_bytes
        self.budget_bytes = budget_bytes
        self.evicted = evicted
        if evicted:
            why = (
                f"Trial {trial_number} was evicted to resolve a deadlock: every running trial "
                f"was waiting for memory. It wanted {nbytes} bytes while holding {held_bytes} "
                f"bytes, and the budget is {budget_bytes} bytes."
            )
            fix = (
                "Run it again with fewer trials on this device (trials_per_device), a smaller "
                "batch size, or a larger memory_budget_bytes."
            )
        else:
            why = (
                f"Trial {trial_number} wanted {nbytes} bytes while holding {held_bytes} bytes; "
                f"together that exceeds the whole budget of {budget_bytes} bytes, so it can "
                "never be admitted, even alone."
            )
            fix = (
                "Use a smaller batch size or model, or a larger memory_budget_bytes "
                "(WaterwaveExecutor(memory_budget_bytes=...))."
            )
        super().__init__(f"{why} {fix}")
