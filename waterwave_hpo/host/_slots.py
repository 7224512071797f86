"""The slot bookkeeping every host handle shares, and the null memory of a remote host.

A host (threads here, worker processes, a Ray actor) has slots that each hold at most one job
the run loop has handed out and not yet seen end (``slot.job``). The loop asks a host for an
idle slot and how many trials it runs; those answers are the same whatever runs the slot.
"""

from __future__ import annotations

from typing import Any
from typing import Generic
from typing import Protocol
from typing import TypeVar


class _HasJob(Protocol):
    job: Any


SlotT = TypeVar("SlotT", bound=_HasJob)


class SlotTable(Generic[SlotT]):
    """Mixin: the host's ``slots``, which of them hold a job, and the first idle one."""

    slots: list[SlotT]

    @property
    def n_running(self) -> int:
        """Trials handed to this host whose outcome the run loop has not handled yet."""
        return sum(1 for slot in self.slots if slot.job is not None)

    def first_idle(self) -> SlotT | None:
        """The first slot whose last job has been handled, or ``None``."""
        for slot in self.slots:
            if slot.job is None:
                return slot
        return None


class NoMemory:
    """The memory of a host whose trials run in another process: the loop's calls do nothing.

    The null object of the run loop's ``HostMemory`` (a worker process or a Ray actor keeps
    its own pool and scheduler, which the driver never sees).
    """

    def trial_ended(self, trial_number: int) -> None:
        """Nothing to release here: the trial's memory lived in the other process."""
