"""The driver's handle to a device host: what the executor's loop needs, wherever the host runs.

Three implement :class:`HostHandle`: :class:`~waterwave_hpo.host.DeviceHost` (slot threads in the
driver's own process: the host is its own handle), process isolation's
:class:`~waterwave_hpo.workers.ProcessHostHandle` (slots that own worker processes, over pipes)
and the Ray executor's :class:`~waterwave_hpo.cluster._handle.RayHostHandle` (a host actor, over
Ray). The loop (``OptimizeRun`` in ``executor/_optimize.py``)
sees only this interface, as Optuna's heartbeat sees only ``BaseHeartbeat``
(``optuna/storages/_heartbeat.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Protocol
from typing import TypeVar

if TYPE_CHECKING:
    import torch

    from waterwave_hpo.host import TrialJob
    from waterwave_hpo.scheduler import PipelineScheduler


class SlotHandle(Protocol):
    """One trial at a time on a host: the executor's thread owns :attr:`job`."""

    job: TrialJob | None
    """The job handed to this slot whose outcome the executor has not handled yet."""

    def interrupt(self) -> None:
        """Stop the slot's running trial (Ctrl+C); the executor has told it FAIL. Never raises."""


class HostMemory(Protocol):
    """The part of a device's memory bookkeeping the executor's loop calls."""

    def trial_ended(self, trial_number: int) -> None:
        """Forget ``trial_number`` (its outcome was handled). Idempotent."""


SlotT = TypeVar("SlotT", bound=SlotHandle)


class HostHandle(Protocol[SlotT]):
    """A device host for one ``optimize`` call, as the executor's loop drives it.

    Preconditions: only the executor's thread calls :meth:`idle_slot`, :meth:`submit`,
    :meth:`running_jobs` and :meth:`shutdown`; :meth:`submit` is only given a slot that
    :meth:`idle_slot` returned since the slot's previous outcome was handled. Every job
    submitted ends with exactly one :class:`~waterwave_hpo.host._outcome.TrialOutcome` on
    the call's outcome queue, whatever happens to the host.
    """

    @property
    def device(self) -> torch.device | str:
        """The device its trials run on.

        The device its trials run on (a label such as ``"10.0.0.2/pid42/cuda:0"`` for a
        remote host).
        """

    @property
    def scheduler(self) -> PipelineScheduler | None:
        """The device's pipeline scheduler in this process, or ``None`` (none, or remote)."""

    @property
    def memory(self) -> HostMemory:
        """The device's memory bookkeeping in this process (a no-op for a remote host)."""

    @property
    def slots(self) -> Sequence[SlotT]:
        """Its ``trials_per_device`` slots."""

    @property
    def n_running(self) -> int:
        """Trials handed to this host whose outcome the executor has not handled yet."""

    def idle_slot(self) -> SlotT | None:
        """A slot that may take a trial now, or ``None`` (all busy, no memory room, or lost)."""

    def submit(self, slot: SlotT, job: TrialJob) -> None:
        """Hand ``job`` to ``slot``; its outcome arrives on the outcome queue."""

    def running_jobs(self) -> list[tuple[SlotT, TrialJob]]:
        """The (slot, job) pairs running now."""

    def shutdown(self, timeout_s: float) -> None:
        """Stop the host, waiting up to ``timeout_s`` seconds. Idempotent."""
