"""The device's memory ledger: who holds how many bytes, against a hard budget."""

from __future__ import annotations

from dataclasses import dataclass
import enum

from waterwave_hpo import _checks


class Phase(enum.Enum):
    """What a reservation is for; the waterwave policy orders requests by it.

    ``RESIDENT``: parameters and gradients, held from a trial's first gate to its end.
    ``FORWARD``: bytes a NodeGroup saves for backward, taken at its forward gate.
    ``BACKWARD``: working memory a group's backward takes (a group that is about to free).
    """

    RESIDENT = "resident"
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True)
class Reservation:
    """A grant of bytes in the ledger, returned by ``PipelineScheduler.acquire``.

    Attributes:
        id: Unique within its scheduler.
        trial_number: The trial that holds it.
        group_index: The NodeGroup it is for (``-1`` for a ``RESIDENT`` reservation).
        nbytes: Bytes held.
        phase: What the bytes are for.
    """

    id: int
    trial_number: int
    group_index: int
    nbytes: int
    phase: Phase


class MemoryLedger:
    """Bytes reserved per trial against ``budget_bytes``. Not thread-safe: the scheduler locks.

    The ledger never holds more than ``budget_bytes``: :meth:`reserve` refuses what does not fit.

    Args:
        budget_bytes: Capacity in bytes, ``> 0``.

    Raises:
        ValueError: If ``budget_bytes`` is not a positive integer.
    """

    def __init__(self, budget_bytes: int) -> None:
        _checks.check_int(
            "budget_bytes",
            budget_bytes,
            minimum=1,
            fix="pass the device's memory budget, e.g. budget_bytes=8 * 2**30 for 8 GiB",
        )
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.peak_bytes = 0
        self._by_id: dict[int, Reservation] = {}
        self._held_by_trial: dict[int, int] = {}
        self._held_by_phase: dict[tuple[int, Phase], int] = {}
        self._ids_by_trial: dict[int, set[int]] = {}

    @property
    def free_bytes(self) -> int:
        """Bytes not reserved, ``budget_bytes - used_bytes``."""
        return self.budget_bytes - self.used_bytes

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit under the budget now."""
        return self.used_bytes + nbytes <= self.budget_bytes

    def reserve(self, reservation: Reservation) -> None:
        """Record ``reservation``.

        Raises:
            ValueError: If it does not fit (``used_bytes + nbytes > budget_bytes``) or its id
                is already held; the scheduler never asks for either.
        """
        if reservation.id in self._by_id or not self.fits(reservation.nbytes):
            raise ValueError(
                f"reservation {reservation!r} does not fit: {self.used_bytes} of "
                f"{self.budget_bytes} bytes used (or its id is already held)"
            )
        self._by_id[reservation.id] = reservation
        t = reservation.trial_number
        self._held_by_trial[t] = self._held_by_trial.get(t, 0) + reservation.nbytes
        key = (t, reservation.phase)
        self._held_by_phase[key] = self._held_by_phase.get(key, 0) + reservation.nbytes
        self._ids_by_trial.setdefault(t, set()).add(reservation.id)
        self.used_bytes += reservation.nbytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def release(self, reservation_id: int) -> Reservation | None:
        """Drop one reservation; return it, or ``None`` if it was already released."""
        reservation = self._by_id.pop(reservation_id, None)
        if reservation is None:
            return None
        t = reservation.trial_number
        self._held_by_trial[t] -= reservation.nbytes
        key = (t, reservation.phase)
        left = self._held_by_phase.get(key, 0) - reservation.nbytes
        if left:
            self._held_by_phase[key] = left
        else:
            self._held_by_phase.pop(key, None)
        self._ids_by_trial[t].discard(reservation_id)
        if not self._ids_by_trial[t]:
            del self._ids_by_trial[t]
            del self._held_by_trial[t]
        self.used_bytes -= reservation.nbytes
        return reservation

    def release_trial(self, trial_number: int) -> int:
        """Drop every reservation of ``trial_number``; return the bytes freed."""
        freed = 0
        for rid in list(self._ids_by_trial.get(trial_number, ())):
            released = self.release(rid)
            if released is not None:
                freed += released.nbytes
        return freed

    def held_bytes(self, trial_number: int, phase: Phase | None = None) -> int:
        """Bytes ``trial_number`` holds (only those of ``phase`` when given)."""
        if phase is None:
            return self._held_by_trial.get(trial_number, 0)
        return self._held_by_phase.get((trial_number, phase), 0)

    def reservations(self, trial_number: int) -> list[Reservation]:
        """The reservations ``trial_number`` holds, oldest first."""
        return sorted(
            (self._by_id[rid] for rid in self._ids_by_trial.get(trial_number, ())),
            key=lambda r: r.id,
        )
