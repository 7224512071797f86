"""The pipeline scheduler: one per device host, shared by the NodeGroup gates of its trials.

Interface with the executor (every method is thread-safe):

* ``trial_started(trial_number, trial)``: in the trial's thread (or the host's), before the
  objective runs. Calling it again for a running trial (a retry) first finishes the old run.
* ``trial_finished(trial_number)``: after the objective ends for any reason (complete, pruned,
  failed, evicted). Releases everything the trial holds at once and wakes the waiters.
  Idempotent.
* ``admits(profile=None) -> bool``: before starting one more trial with
  ``trials_per_device="auto"``: whether it fits with the running ones (by the policy's
  :meth:`~Policy.fits`, from the NodeGroup profiles seen so far).
* ``stats() -> SchedulerStats``: any time.

Interface with the gates (waterwave_hpo.nodegroup, in the trial's thread, found through
``current_or_none().scheduler``):

* ``declare_profile(trial_number, profile, key=...)`` once per model after profiling;
* ``acquire(trial_number, group_index, nbytes, phase) -> Reservation``: blocks (the GIL is
  released while waiting on a ``threading.Condition``) until the ledger admits it, or raises
  :class:`BudgetExceededError`;
* ``release(reservation)``: never blocks; may be called from the autograd engine's threads
  (backward hooks). Idempotent.

No hang: the scheduler knows how many trials run (``trial_started``/``trial_finished``) and
how many of them wait in ``acquire``. When all running trials wait and the policy admits
none, it resolves the deadlock at once (no timeouts involved): a request that fits the free
bytes is admitted out of policy order; if none fits, one trial is evicted (least promising,
then the latest started): its gate raises :class:`BudgetExceededError`, and its bytes are
released when the executor calls ``trial_finished`` for it (after its thread has unwound and
its tensors are really free); the others wait for that. Each resolution is recorded in
:meth:`stats`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
import enum
import itertools
import threading
import time
from typing import Any

from waterwave_hpo import _checks
from waterwave_hpo.scheduler._errors import BudgetExceededError
from waterwave_hpo.scheduler._ledger import MemoryLedger
from waterwave_hpo.scheduler._ledger import Phase
from waterwave_hpo.scheduler._ledger import Reservation
from waterwave_hpo.scheduler._policy import LedgerView
from waterwave_hpo.scheduler._policy import Policy
from waterwave_hpo.scheduler._policy import PolicyName
from waterwave_hpo.scheduler._policy import Request
from waterwave_hpo.scheduler._policy import TrialView
from waterwave_hpo.scheduler._policy import make_policy
from waterwave_hpo.scheduler._stats import DeadlockResolution
from waterwave_hpo.scheduler._stats import ResolutionKind
from waterwave_hpo.scheduler._stats import SchedulerStats
from waterwave_hpo.scheduler._stats import TrialSchedulingStats
from waterwave_hpo.scheduler._trial_profile import TrialProfile

_NEUTRAL_PROMISE = 0.5


class _RequestState(enum.Enum):
    WAITING = "waiting"
    GRANTED = "granted"
    EVICTED = "evicted"


@dataclass
class _PendingRequest:
    request: Request
    state: _RequestState = _RequestState.WAITING
    reservation: Reservation | None = None


@dataclass
class _TrialState:
    trial_number: int
    trial: Any
    start_seq: int
    profiles: dict[object, TrialProfile] = field(default_factory=dict)
    pending: dict[int, _PendingRequest] = field(default_factory=dict)
    evicted: bool = False
    acquires: int = 0
    waits: int = 0
    wait_s: float = 0.0
    peak_held_bytes: int = 0

    claim: int | None = None  # sum of the declared profiles' peak_bytes

    def declare(self, key: object, profile: TrialProfile) -> None:
        self.profiles[key] = profile
        self.claim = sum(p.peak_bytes for p in self.profiles.values())

    def snapshot(self, *, finished: bool) -> TrialSchedulingStats:
        return TrialSchedulingStats(
            trial_number=self.trial_number,
            acquires=self.acquires,
            waits=self.waits,
            wait_s=self.wait_s,
            peak_held_bytes=self.peak_held_bytes,
            evicted=self.evicted,
            finished=finished,
        )


class PipelineScheduler:
    """Orders the NodeGroup memory requests of the trials co-hosted on one device.

    After Waterwave (IEEE TC 2023, Sec. 4): each trial's gates reserve a group's bytes in a
    memory ledger before the group's forward and release them after its backward; the policy
    decides who goes when memory is short. On CUDA the budget is the pool's capacity; on the
    CPU it is enforced by the ledger alone (accounted bytes, not measured ones).

    Args:
        budget_bytes: The ledger's capacity in bytes (``> 0``); it is never exceeded.
        policy: ``"waterwave"`` (the NodeGroup pipeline, default), ``"fifo"``, a
            :class:`PolicyName` or a :class:`Policy` instance.
        promise_refresh_s: How often, in seconds, the trials' promise (their latest
            intermediate values in their Optuna study) is re-read; ``float("inf")`` never.
        clock: Seconds, monotonic (for tests).

    Raises:
        ValueError: If ``budget_bytes`` is not a positive int or ``policy`` names no policy.
        TypeError: If ``policy`` has the wrong type.
    """

    def __init__(
        self,
        budget_bytes: int,
        policy: str | PolicyName | Policy = PolicyName.WATERWAVE,
        *,
        promise_refresh_s: float = 1.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._ledger = MemoryLedger(budget_bytes)
        self._policy = make_policy(policy)
        # `with self._lock` (C-level: taken and entered in one step), never `with self._cond`:
        # a trial's thread may be interrupted asynchronously (Ctrl+C's clean-up), and raised in
        # Condition.__enter__ (Python) right after the lock was taken, the lock stays held.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._clock = clock
        self._t0 = clock()
        self._seq = itertools.count()
        self._trials: dict[int, _TrialState] = {}
        self._finished: dict[int, TrialSchedulingStats] = {}
        self._waiting: dict[int, _PendingRequest] = {}
        self._resolutions: list[DeadlockResolution] = []
        self._profiles_seen: list[TrialProfile] = []
        self._promise: dict[int, float] = {}
        self._promise_refresh_s = _checks.check_number(
            "promise_refresh_s",
            promise_refresh_s,
            allow_zero=True,
            fix="pass seconds >= 0 between refreshes of the trials' promise, e.g. 1.0",
        )
        self._promise_at = -float("inf")
        self._deferred: collections.deque[Reservation] = collections.deque()

    # ---------------------------------------------------------------- properties
    @property
    def budget_bytes(self) -> int:
        """The ledger's capacity in bytes."""
        return self._ledger.budget_bytes

    @property
    def policy(self) -> Policy:
        """The policy in use."""
        return self._policy

    def held_bytes(self, trial_number: int) -> int:
        """Bytes ``trial_number`` holds in the ledger now (0 if none or unknown)."""
        with self._lock:
            return self._ledger.held_bytes(trial_number)

    @property
    def used_bytes(self) -> int:
        """Bytes reserved in the ledger now, all trials."""
        with self._lock:
            return self._ledger.used_bytes

    def room_bytes(self, trial_number: int) -> int:
        """Bytes of the budget the other running trials leave to ``trial_number``.

        The budget less, for every other running trial that was not evicted, the larger of
        its claim (its declared profiles' peak bytes) and what it holds now: what a memory
        plan for ``trial_number`` may use (``WaterwaveExecutor(memory_plan="home")``). May be
        negative when the others claim more than the budget.
        """
        with self._lock:
            others = 0
            for n, t in self._trials.items():
                if n == trial_number or t.evicted:
                    continue
                others += max(t.claim or 0, self._ledger.held_bytes(n))
            return self._ledger.budget_bytes - others

    @property
    def largest_profile(self) -> TrialProfile | None:
        """The largest (by ``peak_bytes``) of the last 64 profiles declared, or ``None``.

        What :meth:`admits` assumes for a newcomer, and what ``trials_per_device="auto"``
        simulates (:func:`waterwave_hpo.sim.predict_auto_packing`).
        """
        with self._lock:
            return max(self._profiles_seen, key=lambda p: p.peak_bytes, default=None)

    # ---------------------------------------------------------------- executor side
    def trial_started(self, trial_number: int, trial: Any = None) -> None:
        """Register a trial before its objective runs (precondition of :meth:`acquire`).

        Args:
            trial_number: ``trial.number``.
            trial: The ``optuna.trial.Trial`` (read for its intermediate values, to favour
                promising trials), or ``None``.
        """
        with self._lock:
            if trial_number in self._trials:
                self._finish_locked(trial_number)
            self._finished.pop(trial_number, None)
            self._trials[trial_number] = _TrialState(trial_number, trial, next(self._seq))

    def trial_finished(self, trial_number: int) -> None:
        """Release everything ``trial_number`` holds and forget it. Idempotent.

        Call it after the objective ends for any reason. A request of that trial still
        waiting (another thread of it) raises :class:`BudgetExceededError`.
        """
        with self._lock:
            if trial_number not in self._trials:
                return
            self._finish_locked(trial_number)
            self._dispatch_locked()
            self._resolve_deadlock_locked()

    def admits(self, profile: TrialProfile | int | None = None) -> bool:
        """Whether one more trial fits next to the running ones (``trials_per_device="auto"``).

        Args:
            profile: The newcomer's profile; an ``int`` is its solo peak in bytes (no pipeline
                gain assumed); ``None`` assumes the largest profile seen so far.

        Returns:
            ``policy.fits(running profiles + [profile], budget_bytes)``. With ``profile=None``
            and no profile seen yet: ``True`` only if no trial is running (the first trial
            profiles the model; ask again once its gates have declared the profile).
        """
        with self._lock:
            running = [t for t in self._trials.values() if not t.evicted]
            if profile is None:
                largest = max(self._profiles_seen, key=lambda p: p.peak_bytes, default=None)
                if largest is None:
                    return not running
                profile = largest
            elif isinstance(profile, int):
                profile = TrialProfile(0, (profile,))
            if any(not t.profiles for t in running):
                return False
            profiles = [_combined(t.profiles.values()) for t in running]
            return self._policy.fits([*profiles, profile], self._ledger.budget_bytes)

    def stats(self) -> SchedulerStats:
        """A snapshot: ledger use and peak, waits per trial, deadlocks resolved."""
        with self._lock:
            per_trial = dict(self._finished)
            for n, t in self._trials.items():
                per_trial[n] = t.snapshot(finished=False)
            resolutions = tuple(self._resolutions)
            return SchedulerStats(
                policy=self._policy.name,
                budget_bytes=self._ledger.budget_bytes,
                used_bytes=self._ledger.used_bytes,
                peak_bytes=self._ledger.peak_bytes,
                deadlocks_resolved=len(resolutions),
                evictions=sum(r.kind is ResolutionKind.EVICTED for r in resolutions),
                resolutions=resolutions,
                trials=tuple(per_trial[n] for n in sorted(per_trial)),
            )

    # ---------------------------------------------------------------- gate side
    def declare_profile(self, trial_number: int, profile: TrialProfile, *, key: object = 0) -> None:
        """Tell the scheduler what one model of a trial needs per step (its claim).

        Args:
            trial_number: A started trial.
            profile: The model's NodeGroup profile.
            key: Which model of the trial (e.g. ``id(model)``); a trial with two models
                declares two profiles.

        Raises:
            ValueError: If the trial was not started.
        """
        with self._lock:
            self._state_locked(trial_number).declare(key, profile)
            self._profiles_seen.append(profile)
            del self._profiles_seen[:-64]
            self._dispatch_locked()

    def declared(self, trial_number: int, *, key: object = 0) -> bool:
        """Whether ``trial_number`` has declared a profile under ``key`` (since it started).

        ``False`` for a trial that is not running.
        """
        with self._lock:
            state = self._trials.get(trial_number)
            return state is not None and key in state.profiles

    def acquire(
        self,
        trial_number: int,
        group_index: int,
        nbytes: int,
        phase: Phase = Phase.FORWARD,
    ) -> Reservation:
        """Reserve ``nbytes`` for a NodeGroup; block until the ledger admits them.

        Called by a forward gate in the trial's own thread. While waiting the GIL is released.

        Args:
            trial_number: A started trial.
            group_index: The group (``-1`` for ``Phase.RESIDENT``).
            nbytes: Bytes, ``>= 0``.
            phase: What the bytes are for.

        Returns:
            The reservation; give it back with :meth:`release`.

        Raises:
            ValueError: If ``nbytes`` is negative or the trial was not started.
            BudgetExceededError: If the trial's holdings plus ``nbytes`` exceed the budget, or
                the trial is (or gets) evicted to resolve a deadlock.
        """
        _checks.check_int("nbytes", nbytes, minimum=0, fix="pass a size in bytes")
        self._maybe_refresh_promise()
        with self._lock:
            state = self._state_locked(trial_number)
            held = self._ledger.held_bytes(trial_number)
            if state.evicted:
                raise BudgetExceededError(
                    trial_number, nbytes, held, self.budget_bytes, evicted=True
                )
            if held + nbytes > self._ledger.budget_bytes:
                raise BudgetExceededError(
                    trial_number, nbytes, held, self.budget_bytes, evicted=False
                )
            seq = next(self._seq)
            pending = _PendingRequest(
                Request(
                    seq=seq,
                    trial_number=trial_number,
                    group_index=group_index,
                    nbytes=nbytes,
                    phase=phase,
                    promise=self._promise.get(trial_number, _NEUTRAL_PROMISE),
                )
            )
            state.acquires += 1
            self._waiting[seq] = pending
            state.pending[seq] = pending
            self._dispatch_locked()
            if pending.state is _RequestState.WAITING:
                state.waits += 1
                started = self._clock()
                self._resolve_deadlock_locked()
                while pending.state is _RequestState.WAITING:
                    self._cond.wait()
                state.wait_s += self._clock() - started
            if pending.state is _RequestState.EVICTED:
                raise BudgetExceededError(
                    trial_number, nbytes, held, self.budget_bytes, evicted=True
                )
            assert pending.reservation is not None
            return pending.reservation

    def release(self, reservation: Reservation) -> None:
        """Give back a reservation. Never waits for memory; idempotent; any thread.

        Backward hooks call it from the autograd engine's threads.
        """
        with self._lock:
            self._drain_deferred_locked()
            if self._ledger.release(reservation.id) is None:
                return
            self._dispatch_locked()
            self._resolve_deadlock_locked()

    def release_later(self, reservations: tuple[Reservation, ...]) -> None:
        """Give back reservations from a finalizer or the garbage collector.

        Never blocks: when the scheduler's lock is busy (possibly held by this very thread,
        interrupted by the collector) the release is queued and applied by the lock's holder
        before it lets go, or at the next scheduler call. Idempotent.
        """
        self._deferred.extend(reservations)
        if self._cond.acquire(blocking=False):
            try:
                if self._drain_deferred_locked():
                    self._dispatch_locked()
                    self._resolve_deadlock_locked()
            finally:
                self._cond.release()

    # ---------------------------------------------------------------- internals (locked)
    def _drain_deferred_locked(self) -> bool:
        freed = False
        while self._deferred:
            reservation = self._deferred.popleft()
            freed |= self._ledger.release(reservation.id) is not None
        return freed

    def _state_locked(self, trial_number: int) -> _TrialState:
        state = self._trials.get(trial_number)
        if state is None:
            raise ValueError(
                f"trial {trial_number} is not running on this scheduler. Call "
                f"scheduler.trial_started({trial_number}, trial) before its gates run "
                "(the executor does this)."
            )
        return state

    def _finish_locked(self, trial_number: int) -> None:
        state = self._trials.pop(trial_number)
        self._ledger.release_trial(trial_number)
        for seq, pending in state.pending.items():
            pending.state = _RequestState.EVICTED
            self._waiting.pop(seq, None)
        state.pending.clear()
        self._finished[trial_number] = state.snapshot(finished=True)
        self._promise.pop(trial_number, None)
        self._cond.notify_all()

    def _view_locked(self) -> LedgerView:
        trials = {}
        for n, t in self._trials.items():
            if t.evicted:  # it needs nothing more and frees all it holds when it finishes
                held = self._ledger.held_bytes(n)
                trials[n] = TrialView(n, held, 0, held, 0, 0.0)
                continue
            trials[n] = TrialView(
                trial_number=n,
                held_bytes=self._ledger.held_bytes(n),
                resident_held_bytes=self._ledger.held_bytes(n, Phase.RESIDENT),
                claim_bytes=t.claim,
                pending_bytes=sum(p.request.nbytes for p in t.pending.values()),
                promise=self._promise.get(n, _NEUTRAL_PROMISE),
            )
        return LedgerView(self._ledger.budget_bytes, self._ledger.free_bytes, trials)

    def _grant_locked(self, pending: _PendingRequest) -> None:
        r = pending.request
        reservation = Reservation(next(self._seq), r.trial_number, r.group_index, r.nbytes, r.phase)
        self._ledger.reserve(reservation)
        pending.reservation = reservation
        pending.state = _RequestState.GRANTED
        del self._waiting[r.seq]
        state = self._trials[r.trial_number]
        del state.pending[r.seq]
        state.peak_held_bytes = max(state.peak_held_bytes, self._ledger.held_bytes(r.trial_number))

    def _dispatch_locked(self) -> None:
        self._drain_deferred_locked()
        granted = False
        while self._waiting:
            waiting = [p.request for p in self._waiting.values()]
            chosen = self._policy.select(waiting, self._view_locked())
            if chosen is None:
                break
            if chosen.seq not in self._waiting or chosen.nbytes > self._ledger.free_bytes:
                raise RuntimeError(
                    f"policy {self._policy.name!r} selected {chosen!r}, which is not waiting "
                    f"or does not fit the {self._ledger.free_bytes} free bytes; a Policy.select "
                    "must return a waiting request that fits, or None."
                )
            self._grant_locked(self._waiting[chosen.seq])
            granted = True
        if granted:
            self._cond.notify_all()

    def _resolve_deadlock_locked(self) -> None:
        if self._drain_deferred_locked():
            self._dispatch_locked()
        while self._waiting:
            if any(t.evicted for t in self._trials.values()):
                return  # a victim is unwinding; its trial_finished frees its memory
            running = list(self._trials.values())
            if not running or any(not t.pending for t in running):
                return
            waiting_trials = tuple(sorted(t.trial_number for t in running))
            fitting = [
                p for p in self._waiting.values() if p.request.nbytes <= self._ledger.free_bytes
            ]
            if fitting:
                chosen = min(fitting, key=lambda p: self._policy.priority(p.request))
                self._grant_locked(chosen)
                self._record_locked(
                    ResolutionKind.ADMITTED_OUT_OF_ORDER,
                    chosen.request,
                    waiting_trials,
                    "every running trial was waiting and the policy admitted none; this "
                    "request fitted the free bytes and was admitted out of policy order",
                )
            else:
                victim = self._choose_victim_locked(running)
                wanted = min(victim.pending.values(), key=lambda p: p.request.seq).request
                self._record_locked(
                    ResolutionKind.EVICTED,
                    wanted,
                    waiting_trials,
                    f"every running trial was waiting and no request fitted the "
                    f"{self._ledger.free_bytes} free bytes; trial {victim.trial_number} "
                    "was evicted: its gate raised BudgetExceededError and its memory is "
                    "released when the executor calls trial_finished for it",
                )
                victim.evicted = True
                for seq, pending in victim.pending.items():
                    pending.state = _RequestState.EVICTED
                    self._waiting.pop(seq, None)
                victim.pending.clear()
            self._cond.notify_all()
            self._dispatch_locked()

    def _choose_victim_locked(self, running: list[_TrialState]) -> _TrialState:
        """Keep the trial most likely to finish; evict the least promising, youngest other."""

        def promise(t: _TrialState) -> float:
            return self._promise.get(t.trial_number, _NEUTRAL_PROMISE)

        budget = self._ledger.budget_bytes

        def can_finish_alone(t: _TrialState) -> bool:
            need = sum(p.request.nbytes for p in t.pending.values())
            return self._ledger.held_bytes(t.trial_number) + need <= budget

        keeper = max(
            running,
            key=lambda t: (
                can_finish_alone(t),
                promise(t),
                self._ledger.held_bytes(t.trial_number),
                -t.start_seq,
            ),
        )
        others = [t for t in running if t is not keeper] or running
        return min(others, key=lambda t: (promise(t), -t.start_seq))

    def _record_locked(
        self,
        kind: ResolutionKind,
        request: Request,
        waiting_trials: tuple[int, ...],
        reason: str,
    ) -> None:
        self._resolutions.append(
            DeadlockResolution(
                kind=kind,
                trial_number=request.trial_number,
                nbytes=request.nbytes,
                at_s=self._clock() - self._t0,
                waiting_trials=waiting_trials,
                reason=reason,
            )
        )

    # ---------------------------------------------------------------- promise (HPO-aware)
    def _maybe_refresh_promise(self) -> None:
        now = self._clock()
        if now - self._promise_at < self._promise_refresh_s:
            return
        self._promise_at = now
        with self._lock:
            trials = {n: t.trial for n, t in self._trials.items() if t.trial is not None}
        promise = _promise_from_studies(trials)
        with self._lock:
            self._promise = {n: p for n, p in promise.items() if n in self._trials}


def _combined(profiles: Any) -> TrialProfile:
    out = TrialProfile(0, ())
    for p in profiles:
        out = out.combine(p)
    return out


def _promise_from_studies(trials: dict[int, Any]) -> dict[int, float]:
    """Rank running trials by their latest intermediate value within their study.

    Returns ``trial_number -> promise`` in ``[0, 1]`` (1 best) for trials with at least one
    intermediate value in a single-objective study; others are left out (neutral).
    """
    by_study: dict[int, tuple[Any, list[int]]] = {}
    for n, trial in trials.items():
        study = getattr(trial, "study", None)
        if study is None:
            continue
        by_study.setdefault(id(study), (study, []))[1].append(n)
    out: dict[int, float] = {}
    for study, numbers in by_study.values():
        try:
            from optuna.study import StudyDirection
            from optuna.trial import TrialState

            maximize = study.direction == StudyDirection.MAXIMIZE
            frozen = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        except (AttributeError, RuntimeError, ValueError, ImportError):
            continue  # multi-objective, a stub without a study, or a storage error
        wanted = set(numbers)
        values: list[tuple[float, int]] = []
        for ft in frozen:
            if ft.number in wanted and ft.intermediate_values:
                last = ft.intermediate_values[max(ft.intermediate_values)]
                values.append((-last if maximize else last, ft.number))
        values.sort()
        if len(values) == 1:
            out[values[0][1]] = _NEUTRAL_PROMISE
        for rank, (_, n) in enumerate(values if len(values) > 1 else ()):
            out[n] = 1.0 - rank / (len(values) - 1)
    return out
