"""The discrete-event model of one shared device: ``simulate(trials, device, sharing)``.

Events are the ends of pieces of work and the grants of memory. Between events every running
piece of work advances at a constant rate:

* device work: a piece alone runs at its solo speed; two or more share
  ``SimDevice.compute_parallelism`` equally (processor sharing), each at most at its solo
  speed; across processes without MPS the device is time-sliced (parallelism 1);
* host work (Python dispatch under the GIL): one host per process, shared equally by that
  process's co-hosted trials; a pass ends when both its host and its device work are done
  (launches are asynchronous, so the two overlap).

Memory goes through the same decisions as the real scheduler: with a policy, NodeGroup
requests wait in a ledger and the *same* :class:`~waterwave_hpo.scheduler.Policy` objects pick
what to admit (``select``), with the scheduler's deadlock resolution (admit a fitting request out
of order, else evict the youngest trial); without one, an allocation that does not fit is an
out-of-memory error, as with PyTorch's stock allocator.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field

from waterwave_hpo.scheduler import FifoPolicy
from waterwave_hpo.scheduler import LedgerView
from waterwave_hpo.scheduler import Phase
from waterwave_hpo.scheduler import Policy
from waterwave_hpo.scheduler import Request
from waterwave_hpo.scheduler import TrialProfile
from waterwave_hpo.scheduler import TrialView
from waterwave_hpo.scheduler import make_policy
from waterwave_hpo.sim._result import AttemptOutcome
from waterwave_hpo.sim._result import SimAttempt
from waterwave_hpo.sim._result import SimResult
from waterwave_hpo.sim._spec import PLAN_SHRINK
from waterwave_hpo.sim._spec import Sharing
from waterwave_hpo.sim._spec import SimDevice
from waterwave_hpo.sim._spec import SimTrial

_EPS = 1e-12
_NEUTRAL_PROMISE = 0.5
_CONTEXT_KEY = -2
_RESIDENT_KEY = -1
_EVICTED = object()


@dataclass(frozen=True)
class _Acquire:
    key: int
    nbytes: int
    phase: Phase


@dataclass(frozen=True)
class _Work:
    host_s: float
    device_s: float


@dataclass(frozen=True)
class _Release:
    key: int


_Op = _Acquire | _Work | _Release


def _program(
    trial: SimTrial, context_bytes: int, start_s: float = 0.0
) -> Generator[_Op, None, None]:
    if start_s > 0:
        yield _Work(start_s, 0.0)  # the process starting up, on its own host
    if context_bytes:
        yield _Acquire(_CONTEXT_KEY, context_bytes, Phase.RESIDENT)
    if trial.profile.resident_bytes:
        yield _Acquire(_RESIDENT_KEY, trial.profile.resident_bytes, Phase.RESIDENT)
    n = len(trial.profile.group_bytes)
    for _ in range(trial.steps):
        for g in range(n):
            yield _Acquire(g, trial.profile.group_bytes[g], Phase.FORWARD)
            yield _Work(trial.host_s, trial.forward_s[g])
        for g in reversed(range(n)):
            yield _Work(trial.host_s, trial.backward_s[g])
            yield _Release(g)


@dataclass
class _Run:
    run_id: int
    trial_index: int
    attempt: int
    start_s: float
    slot: int
    claim_bytes: int
    program: Generator[_Op, None, None]
    held: dict[int, int] = field(default_factory=dict)
    planned: bool = False
    pending: Request | None = None
    host_left: float = 0.0
    device_left: float = 0.0
    working: bool = False
    peak_held: int = 0

    @property
    def held_bytes(self) -> int:
        return sum(self.held.values())


@dataclass
class _Queued:
    trial_index: int
    attempt: int
    max_running: int | None
    cap_bytes: int | None = None
    """With memory plans: a re-run's plan may use at most this many bytes."""


class _Simulation:
    def __init__(self, trials: Sequence[SimTrial], device: SimDevice, sharing: Sharing) -> None:
        self.trials = list(trials)
        self.device = device
        self.sharing = sharing
        self.policy: Policy | None = (
            None if sharing.policy is None else make_policy(sharing.policy)  # type: ignore[arg-type]
        )
        self.fits_policy: Policy = self.policy if self.policy is not None else FifoPolicy()
        self.cap = device.capacity_bytes
        self.context_bytes = device.context_bytes if sharing.processes else 0
        self.now = 0.0
        self.used = 0
        self.peak = 0
        self.seq = 0
        self.fresh: deque[_Queued] = deque(_Queued(i, 0, None) for i in range(len(self.trials)))
        self.retries: deque[_Queued] = deque()
        self.running: dict[int, _Run] = {}
        self.free_slots = list(range(self._max_slots()))
        self.started_slots: set[int] = set()
        self.attempts: list[SimAttempt] = []
        self.failed: set[int] = set()
        self.completed: set[int] = set()
        self.ooms = 0
        self.evictions = 0
        self.max_concurrent = 0
        self.timeline: list[tuple[float, int]] = [(0.0, 0)]
        self.largest_seen: TrialProfile | None = None
        self.auto_caps: dict[TrialProfile, int | None] = {}
        self.plans_of = {t.profile: t.plan for t in self.trials if t.plan is not None}
        self.n_planned = 0

    def _max_slots(self) -> int:
        c = self.sharing.concurrency
        return self.sharing.max_concurrency if c == "auto" else int(c)

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    # ----------------------------------------------------------------- memory
    def _set_used(self, delta: int) -> None:
        self.used += delta
        self.peak = max(self.peak, self.used)
        if self.timeline and self.timeline[-1][0] == self.now:
            self.timeline[-1] = (self.now, self.used)
        else:
            self.timeline.append((self.now, self.used))

    def _grant(self, run: _Run, key: int, nbytes: int) -> None:
        run.held[key] = run.held.get(key, 0) + nbytes
        run.peak_held = max(run.peak_held, run.held_bytes)
        self._set_used(nbytes)

    def _view(self) -> LedgerView:
        trials = {}
        for run in self.running.values():
            resident = run.held.get(_RESIDENT_KEY, 0) + run.held.get(_CONTEXT_KEY, 0)
            trials[run.run_id] = TrialView(
                trial_number=run.run_id,
                held_bytes=run.held_bytes,
                resident_held_bytes=resident,
                claim_bytes=run.claim_bytes,
                pending_bytes=0 if run.pending is None else run.pending.nbytes,
                promise=_NEUTRAL_PROMISE,
            )
        return LedgerView(self.cap, self.cap - self.used, trials)

    # ----------------------------------------------------------------- trials
    def _start_trials(self) -> None:
        while self.free_slots:
            if self.retries:
                head = self.retries[0]
                if head.max_running is not None and len(self.running) > head.max_running:
                    return
                source = self.retries
            elif self.fresh:
                head = self.fresh[0]
                source = self.fresh
            else:
                return
            if self.sharing.concurrency == "auto" and self.running:
                profiles = [self.trials[r.trial_index].profile for r in self.running.values()]
                nxt = self.trials[head.trial_index].profile
                if self.context_bytes:
                    profiles = [_with_context(p, self.context_bytes) for p in profiles]
                    nxt = _with_context(nxt, self.context_bytes)
                if not self.fits_policy.fits([*profiles, nxt], self.cap):
                    planned = self._planned_profile(head)
                    if planned is None or not self.fits_policy.fits([*profiles, planned], self.cap):
                        return
                    nxt = planned
                cap = self._auto_cap([*profiles, nxt])
                if cap is not None and len(self.running) >= cap:
                    return
            source.popleft()
            self._launch(head)

    def _auto_cap(self, profiles: list[TrialProfile]) -> int | None:
        """``concurrency="auto"`` with a ledger, as the executor.

        ``concurrency="auto"`` with a ledger, as the executor: no more trials at once than
        :func:`~waterwave_hpo.sim.predict_auto_packing` picks for the largest profile seen.
        """
        if self.policy is None:
            return None
        largest = max(profiles, key=lambda p: p.peak_bytes)
        if self.largest_seen is None or largest.peak_bytes > self.largest_seen.peak_bytes:
            self.largest_seen = largest
        if self.largest_seen not in self.auto_caps:
            from waterwave_hpo.sim._packing import predict_auto_packing  # it simulates, too

            plan = self.plans_of.get(self.largest_seen) if self.sharing.memory_plans else None
            try:
                best_k: int | None = predict_auto_packing(
                    self.largest_seen,
                    self.cap,
                    self.policy,
                    self.sharing.max_concurrency,
                    plan=plan,
                ).best_k
            except ValueError:  # does not fit alone: it runs (and fails) alone
                best_k = None
            self.auto_caps[self.largest_seen] = best_k
        return self.auto_caps[self.largest_seen]

    def _room(self) -> int:
        """The capacity less the running trials' claims (what the executor plans for)."""
        return self.cap - sum(r.claim_bytes for r in self.running.values())

    def _plan_for(self, queued: _Queued) -> tuple[int, float] | None:
        """``(planned peak, slowdown)`` for ``queued`` now, or ``None`` to run it plainly.

        As the executor: a trial that fits the room beside its neighbours runs plainly; one
        that does not runs with a plan for the room; when even the smallest plan does not fit
        the room, with the smallest plan (it then waits for memory). A re-run after a failure
        is planned for at most its ``cap_bytes``.
        """
        trial = self.trials[queued.trial_index]
        if not self.sharing.memory_plans or trial.plan is None:
            return None
        plain = trial.profile.peak_bytes
        room = self._room() - self.context_bytes
        if queued.cap_bytes is None and room >= plain:
            return None
        target = room if queued.cap_bytes is None else min(room, queued.cap_bytes)
        planned = trial.plan.at(plain, max(target, 0))
        if planned is None and trial.plan.peak_bytes + self.context_bytes <= self.cap:
            planned = trial.plan.at(plain, trial.plan.peak_bytes)
        if planned is None or planned[0] >= plain:
            return None
        return planned

    def _planned_profile(self, queued: _Queued) -> TrialProfile | None:
        planned = self._plan_for(queued)
        if planned is None:
            return None
        n = len(self.trials[queued.trial_index].profile.group_bytes)
        return TrialProfile(planned[0] + self.context_bytes, (0,) * n)

    def _launch(self, queued: _Queued) -> None:
        trial = self.trials[queued.trial_index]
        planned = self._plan_for(queued)
        if planned is not None:
            # As the executor: the planned peak is reserved for the trial's whole run, and
            # its steps take ``slowdown`` times as long.
            peak, slowdown = planned
            n = len(trial.profile.group_bytes)
            trial = SimTrial(
                TrialProfile(peak, (0,) * n),
                tuple(f * slowdown for f in trial.forward_s),
                tuple(b * slowdown for b in trial.backward_s),
                trial.steps,
                trial.host_s,
                trial.name,
            )
            self.n_planned += 1
        run_id = self._next_seq()
        slot = self.free_slots.pop(0)
        start_s = 0.0
        if self.sharing.processes and slot not in self.started_slots:
            start_s = self.sharing.process_start_s
        self.started_slots.add(slot)
        run = _Run(
            run_id=run_id,
            trial_index=queued.trial_index,
            attempt=queued.attempt,
            start_s=self.now,
            slot=slot,
            claim_bytes=trial.profile.peak_bytes + self.context_bytes,
            program=_program(trial, self.context_bytes, start_s),
            planned=planned is not None,
        )
        self.running[run_id] = run
        self.max_concurrent = max(self.max_concurrent, len(self.running))
        self._advance(run)

    def _advance(self, run: _Run) -> None:
        """Run the trial's program until it waits for memory or for work to finish."""
        while run.run_id in self.running:
            try:
                op = next(run.program)
            except StopIteration:
                self._end(run, AttemptOutcome.COMPLETE)
                return
            if isinstance(op, _Work):
                if op.host_s <= _EPS and op.device_s <= _EPS:
                    continue
                run.host_left, run.device_left, run.working = op.host_s, op.device_s, True
                return
            if isinstance(op, _Release):
                nbytes = run.held.pop(op.key, 0)
                if nbytes:
                    self._set_used(-nbytes)
                continue
            # _Acquire
            if self.policy is None:
                if self.used + op.nbytes > self.cap:
                    self._end(run, AttemptOutcome.OOM)
                    return
                self._grant(run, op.key, op.nbytes)
                continue
            if run.held_bytes + op.nbytes > self.cap:  # BudgetExceededError at once
                self._end(run, AttemptOutcome.EVICTED)
                return
            run.pending = Request(
                seq=self._next_seq(),
                trial_number=run.run_id,
                group_index=op.key,
                nbytes=op.nbytes,
                phase=op.phase,
                promise=_NEUTRAL_PROMISE,
            )
            return

    def _end(self, run: _Run, outcome: AttemptOutcome) -> None:
        del self.running[run.run_id]
        freed = run.held_bytes
        run.held.clear()
        if freed:
            self._set_used(-freed)
        self.free_slots.append(run.slot)
        self.free_slots.sort()
        self.attempts.append(
            SimAttempt(
                run.trial_index,
                run.attempt,
                run.start_s,
                self.now,
                outcome,
                run.peak_held,
                run.slot,
            )
        )
        if outcome is AttemptOutcome.COMPLETE:
            self.completed.add(run.trial_index)
            return
        if outcome is AttemptOutcome.OOM:
            self.ooms += 1
        else:
            self.evictions += 1
        neighbours = len(self.running)
        plans = self.sharing.memory_plans and self.trials[run.trial_index].plan is not None
        if plans and self.sharing.retry_on_oom and run.attempt < self.sharing.max_retries:
            # As the executor with memory_plan="home": re-run at once beside any neighbours,
            # with a plan for at most PLAN_SHRINK of the footprint that failed.
            cap = int(PLAN_SHRINK * (run.claim_bytes - self.context_bytes))
            plan = self.trials[run.trial_index].plan
            assert plan is not None
            if cap >= plan.peak_bytes:
                self.retries.append(_Queued(run.trial_index, run.attempt + 1, None, cap))
                return
        if self.sharing.retry_on_oom and neighbours > 0 and run.attempt < self.sharing.max_retries:
            self.retries.append(_Queued(run.trial_index, run.attempt + 1, neighbours - 1))
        else:
            self.failed.add(run.trial_index)

    # ----------------------------------------------------------------- the ledger
    def _dispatch(self) -> bool:
        """Admit waiting requests as the policy says.

        Admit waiting requests as the policy (then deadlock resolution) says; True if any
        run changed.
        """
        if self.policy is None:
            return False
        changed = False
        while True:
            waiting = sorted(
                (r.pending for r in self.running.values() if r.pending is not None),
                key=lambda q: q.seq,
            )
            if not waiting:
                return changed
            chosen = self.policy.select(waiting, self._view())
            if chosen is None:
                resolved = self._resolve_deadlock(waiting)
                if resolved is None:
                    return changed
                if resolved is _EVICTED:
                    changed = True
                    continue
                assert isinstance(resolved, Request)
                chosen = resolved
            if chosen.nbytes > self.cap - self.used:
                raise RuntimeError(
                    f"policy {self.policy.name!r} selected {chosen!r}, which does not fit the "
                    f"{self.cap - self.used} free bytes."
                )
            run = self.running[chosen.trial_number]
            run.pending = None
            self._grant(run, chosen.group_index, chosen.nbytes)
            self._advance(run)
            changed = True

    def _resolve_deadlock(self, waiting: list[Request]) -> Request | object | None:
        """Resolve a deadlock as ``PipelineScheduler`` does.

        As ``PipelineScheduler``: when every running trial waits, admit a fitting request
        out of order, else evict one trial (the youngest among those that are not the likeliest
        to finish). Returns a request to grant, ``_EVICTED``, or ``None`` (no deadlock).
        """
        assert self.policy is not None
        runs = list(self.running.values())
        if not runs or any(r.pending is None for r in runs):
            return None
        free = self.cap - self.used
        fitting = [q for q in waiting if q.nbytes <= free]
        if fitting:
            return min(fitting, key=self.policy.priority)

        def can_finish_alone(r: _Run) -> bool:
            assert r.pending is not None
            return r.held_bytes + r.pending.nbytes <= self.cap

        keeper = max(runs, key=lambda r: (can_finish_alone(r), r.held_bytes, -r.run_id))
        others = [r for r in runs if r is not keeper] or runs
        victim = min(others, key=lambda r: -r.run_id)
        victim.pending = None
        self._end(victim, AttemptOutcome.EVICTED)
        return _EVICTED  # _dispatch asks the policy again, with the freed bytes

    # ----------------------------------------------------------------- time
    def _rates(self) -> dict[int, tuple[float, float]]:
        device_users = [r for r in self.running.values() if r.working and r.device_left > _EPS]
        parallelism = self.device.compute_parallelism
        if self.sharing.processes and not self.device.mps:
            parallelism = 1.0
        n = len(device_users)
        device_rate = 1.0 if n == 1 else (min(1.0, parallelism / n) if n else 0.0)
        host_users: dict[int, int] = {}
        for r in self.running.values():
            if r.working and r.host_left > _EPS:
                host = r.run_id if self.sharing.processes else 0
                host_users[host] = host_users.get(host, 0) + 1
        rates = {}
        for r in self.running.values():
            if not r.working:
                continue
            host = r.run_id if self.sharing.processes else 0
            h = 1.0 / host_users[host] if r.host_left > _EPS else 0.0
            d = device_rate if r.device_left > _EPS else 0.0
            rates[r.run_id] = (h, d)
        return rates

    def run(self) -> SimResult:
        self._start_trials()
        while True:
            while self._dispatch():
                pass
            self._start_trials()
            while self._dispatch():
                self._start_trials()
            if not self.running:
                if self.fresh or self.retries:
                    self._start_trials()
                    if self.running:
                        continue
                    raise RuntimeError("simulation stalled: trials queued but none can start")
                break
            rates = self._rates()
            if not rates:
                raise RuntimeError(
                    "simulation stalled: every running trial waits for memory and the "
                    "deadlock resolution freed nothing (a bug in the simulator)."
                )
            dt = float("inf")
            for run_id, (h, d) in rates.items():
                run = self.running[run_id]
                if h > 0:
                    dt = min(dt, run.host_left / h)
                if d > 0:
                    dt = min(dt, run.device_left / d)
            self.now += dt
            finished = []
            for run_id, (h, d) in rates.items():
                run = self.running[run_id]
                run.host_left = max(0.0, run.host_left - h * dt)
                run.device_left = max(0.0, run.device_left - d * dt)
                if run.host_left <= _EPS and run.device_left <= _EPS:
                    run.working = False
                    finished.append(run)
            for run in sorted(finished, key=lambda r: r.run_id):
                if run.run_id in self.running:
                    self._advance(run)
        return SimResult(
            makespan_s=self.now,
            attempts=tuple(self.attempts),
            n_complete=len(self.completed),
            n_failed=len(self.failed - self.completed),
            ooms=self.ooms,
            evictions=self.evictions,
            peak_bytes=self.peak,
            max_concurrent=self.max_concurrent,
            memory_timeline=tuple(self.timeline),
            n_planned=self.n_planned,
        )


def _with_context(profile: TrialProfile, context_bytes: int) -> TrialProfile:
    return TrialProfile(profile.resident_bytes + context_bytes, profile.group_bytes)


def simulate(
    trials: Sequence[SimTrial], device: SimDevice, sharing: Sharing | None = None
) -> SimResult:
    """Simulate ``trials`` sharing ``device`` as ``sharing`` says; deterministic.

    Trials start in the given order as slots free up; re-runs after an out-of-memory error or
    an eviction go first, once few enough trials run (the executor's ``on_oom="retry"``).

    Args:
        trials: The trials (their profiles in bytes, their solo timings in seconds).
        device: Capacity (bytes), compute parallelism, per-process context bytes, MPS.
        sharing: Concurrency, policy (``None``: the stock allocator, no ledger), processes,
            retries. ``None``: one trial at a time under the waterwave policy.

    Returns:
        The makespan (seconds), every attempt, OOMs, evictions, peak bytes and the memory
        timeline.

    Raises:
        ValueError: If ``trials`` is empty or a policy name is unknown.
        TypeError: If an element of ``trials`` is not a :class:`SimTrial`.
    """
    trials = list(trials)
    if not trials:
        raise ValueError("trials is empty; pass at least one SimTrial.")
    for i, t in enumerate(trials):
        if not isinstance(t, SimTrial):
            raise TypeError(
                f"trials[{i}] is of type {type(t).__name__!r} but must be a SimTrial; build "
                "one with SimTrial(profile, forward_s, backward_s) or "
                "SimTrial.uniform(profile, step_s)."
            )
    return _Simulation(trials, device, sharing or Sharing()).run()
