"""Scheduling policies: which waiting NodeGroup request the ledger admits next.

A policy is pure decision (no locks, no threads): the scheduler shows it the waiting requests
and a read-only view of the ledger and asks for the next request to admit, one at a time,
until it answers ``None``. The scheduler guarantees the budget and resolves deadlocks, so a
policy can be wrong about throughput but never about safety.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
import enum
from typing import ClassVar

from waterwave_hpo import _checks
from waterwave_hpo.scheduler._ledger import Phase
from waterwave_hpo.scheduler._trial_profile import TrialProfile


class PolicyName(enum.Enum):
    """The built-in policies, by the name ``PipelineScheduler(policy=...)`` accepts."""

    FIFO = "fifo"
    WATERWAVE = "waterwave"


@dataclass(frozen=True)
class Request:
    """A waiting ``acquire`` as a policy sees it.

    Attributes:
        seq: Arrival order (smaller came first), unique per scheduler.
        trial_number: The asking trial.
        group_index: The NodeGroup (``-1`` for ``RESIDENT``).
        nbytes: Bytes asked for.
        phase: What for.
        promise: The trial's promise in ``[0, 1]`` (1: best intermediate value among running
            trials of its study; 0.5 when unknown).
    """

    seq: int
    trial_number: int
    group_index: int
    nbytes: int
    phase: Phase
    promise: float


@dataclass(frozen=True)
class TrialView:
    """One running trial in a :class:`LedgerView`.

    Attributes:
        trial_number: The trial.
        held_bytes: Bytes it holds now (all phases).
        resident_held_bytes: Of which ``RESIDENT`` (kept across steps).
        claim_bytes: Its most per step (``TrialProfile.peak_bytes`` summed over its
            models), or ``None`` before its gates have declared a profile.
        pending_bytes: Bytes of its requests now waiting.
        promise: As in :class:`Request`.
    """

    trial_number: int
    held_bytes: int
    resident_held_bytes: int
    claim_bytes: int | None
    pending_bytes: int
    promise: float


@dataclass(frozen=True)
class LedgerView:
    """What a policy may read: the budget, the free bytes, the running trials."""

    budget_bytes: int
    free_bytes: int
    trials: Mapping[int, TrialView]


class Policy(abc.ABC):
    """Interface of a scheduling policy (subclass it to add one).

    Every policy must pass ``waterwave_hpo.scheduler.testing.check_policy`` (see there).
    """

    name: ClassVar[str] = "policy"

    @abc.abstractmethod
    def select(self, waiting: Sequence[Request], view: LedgerView) -> Request | None:
        """Pick the next request to admit now, or ``None`` to admit none yet.

        Called with the scheduler's lock held, repeatedly, with a fresh view after each
        grant. Must be fast (it runs on every gate) and must not block.

        Args:
            waiting: The waiting requests, non-empty, ascending ``seq``.
            view: The ledger now.

        Returns:
            One element of ``waiting`` whose ``nbytes <= view.free_bytes``, or ``None``.
        """

    @abc.abstractmethod
    def fits(self, profiles: Sequence[TrialProfile], budget_bytes: int) -> bool:
        """Whether trials with these profiles can all run together under this policy.

        Used by ``PipelineScheduler.admits`` (``trials_per_device="auto"``).
        """

    def priority(self, request: Request) -> tuple[float, ...]:
        """Sort key for admitting out of the policy's order to resolve a deadlock.

        Sort key, smallest first, the scheduler uses among requests that fit when it
        must admit out of the policy's order to resolve a deadlock. Default: promise, then
        arrival.
        """
        return (-request.promise, request.seq)


class FifoPolicy(Policy):
    """Admit in arrival order while the ledger fits (the baseline).

    Head-of-line: while the oldest waiting request does not fit, nothing behind it is admitted.
    No look-ahead, so co-hosted trials whose forward peaks coincide deadlock, and the
    scheduler evicts one of them.
    """

    name: ClassVar[str] = PolicyName.FIFO.value

    def select(self, waiting: Sequence[Request], view: LedgerView) -> Request | None:
        head = min(waiting, key=lambda r: r.seq)
        return head if head.nbytes <= view.free_bytes else None

    def fits(self, profiles: Sequence[TrialProfile], budget_bytes: int) -> bool:
        """Every trial's whole peak at once: ``sum(peak_bytes) <= budget_bytes``."""
        return sum(p.peak_bytes for p in profiles) <= budget_bytes

    def priority(self, request: Request) -> tuple[float, ...]:
        return (float(request.seq),)


class WaterwavePolicy(Policy):
    """The NodeGroup pipeline (Waterwave, IEEE TC 2023, Sec. 4 "NodeGroup pipeline").

    Order: requests of groups that are about to free memory (``BACKWARD``) first; then
    forward groups of trials already inside a forward pass (they reach their backward, and
    free, sooner), deepest first; then the first group of a new step; then ``RESIDENT``
    requests of trials not yet started. Within a class, the more promising trial first
    (beyond the paper: the HPO-aware choice), then arrival.

    A request is admitted only if the ledger stays *safe* (banker's algorithm over the
    declared per-step claims): after the grant there is still an order in which every running
    trial can finish its step and free its activations. So a new forward starts only when it
    cannot starve the forward already running: the forward peaks of co-hosted trials do not
    coincide, one trial's forward allocates while another's backward frees. A trial that
    holds nothing yet (waiting for its first grant, usually its ``RESIDENT`` bytes) does not
    count in others' checks: it is admitted only when it keeps the state safe, so a trial
    that would not fit next to the running ones waits for one of them to end.
    Trials with no declared profile are assumed to need only what they are asking for.
    """

    name: ClassVar[str] = PolicyName.WATERWAVE.value

    def select(self, waiting: Sequence[Request], view: LedgerView) -> Request | None:
        best: Request | None = None
        best_key: tuple[float, ...] = ()
        for r in waiting:
            if r.nbytes > view.free_bytes:
                continue
            key = self.priority(r)
            if best is not None and key >= best_key:
                continue
            if self._safe(r, view):
                best, best_key = r, key
        return best

    def priority(self, request: Request) -> tuple[float, ...]:
        if request.phase is Phase.BACKWARD:
            cls = 0
        elif request.phase is Phase.RESIDENT:
            cls = 3
        elif request.group_index > 0:
            cls = 1
        else:
            cls = 2
        depth = request.group_index if cls == 1 else 0
        return (cls, -request.promise, -depth, request.seq)

    def fits(self, profiles: Sequence[TrialProfile], budget_bytes: int) -> bool:
        """All residents, plus the largest forward peak.

        All residents, plus the largest forward peak: the pipeline serves one forward
        peak at a time, ``sum(resident) + max(activation) <= budget_bytes``.
        """
        if not profiles:
            return True
        need = sum(p.resident_bytes for p in profiles) + max(p.activation_bytes for p in profiles)
        return need <= budget_bytes

    @staticmethod
    def _safe(request: Request, view: LedgerView) -> bool:
        """Banker's safety check of the state after granting ``request``."""
        free = view.free_bytes - request.nbytes
        needs: list[tuple[int, int]] = []  # (more bytes needed this step, bytes freed at its end)
        for t in view.trials.values():
            if t.trial_number != request.trial_number and t.held_bytes == 0:
                continue  # not admitted yet: it waits, and its own first grant is checked
            held = t.held_bytes
            resident = t.resident_held_bytes
            pending = t.pending_bytes
            if t.trial_number == request.trial_number:
                held += request.nbytes
                pending -= request.nbytes
                if request.phase is Phase.RESIDENT:
                    resident += request.nbytes
            if t.claim_bytes is None:
                need = max(0, pending)
            else:
                need = max(0, t.claim_bytes - held, pending)
            needs.append((need, held - resident))
        needs.sort()
        progress = True
        while needs and progress:
            progress = False
            remaining: list[tuple[int, int]] = []
            for need, frees in needs:
                if need <= free:
                    free += frees
                    progress = True
                else:
                    remaining.append((need, frees))
            needs = remaining
        return not needs


def make_policy(policy: str | PolicyName | Policy) -> Policy:
    """Resolve ``PipelineScheduler(policy=...)`` to a :class:`Policy` instance.

    Raises:
        ValueError: If ``policy`` is a string that names no built-in policy.
        TypeError: If it is neither a string, a :class:`PolicyName` nor a :class:`Policy`.
    """
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str) and not isinstance(policy, PolicyName):
        try:
            policy = PolicyName(policy)
        except ValueError:
            raise _checks.value_error(
                "policy",
                policy,
                "is not a known policy",
                f"pass one of {[p.value for p in PolicyName]} or a Policy instance",
            ) from None
    if isinstance(policy, PolicyName):
        return FifoPolicy() if policy is PolicyName.FIFO else WaterwavePolicy()
    raise _checks.type_error(
        "policy", policy, "a str, a PolicyName or a Policy", "pass e.g. policy='waterwave'"
    )
