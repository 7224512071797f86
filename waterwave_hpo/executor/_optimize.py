"""The loop of one ``WaterwaveExecutor.optimize`` call: ask, hand trials to hosts, tell, retry.

:class:`~waterwave_hpo.executor.WaterwaveExecutor` is the public, thin class (its arguments,
their checks, its docstrings); this module is its run loop, as Optuna's ``Study.optimize`` calls
``optuna/study/_optimize.py``. It lives in the calling thread; the hosts' slot threads reach it
only through the outcome queue of :class:`~waterwave_hpo.host._device_host.RunSettings`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
import contextlib
from dataclasses import dataclass
import gc
import logging
import queue
import time
from typing import TYPE_CHECKING
from typing import Any

import optuna
from optuna.trial import FrozenTrial
from optuna.trial import TrialState

from waterwave_hpo import _optuna_compat
from waterwave_hpo.executor._ctrl_c import CtrlC
from waterwave_hpo.executor._ctrl_c import release_interrupted_frames
from waterwave_hpo.executor._handle import HostHandle
from waterwave_hpo.executor._storage_errors import is_storage_error
from waterwave_hpo.executor._storage_errors import refused_write_error
from waterwave_hpo.executor._storage_errors import running_trials
from waterwave_hpo.host import ATTR_ATTEMPT
from waterwave_hpo.host import ATTR_FAIL_REASON
from waterwave_hpo.host import ATTR_PLAN_CAP
from waterwave_hpo.host import ATTR_RETRY_OF
from waterwave_hpo.host import BatchedObjective
from waterwave_hpo.host import MemoryPlanMode
from waterwave_hpo.host import OutcomeKind
from waterwave_hpo.host import RunSettings
from waterwave_hpo.host import TrialJob
from waterwave_hpo.host import TrialOutcome
from waterwave_hpo.host import TrialPlanning
from waterwave_hpo.host import planned_rerun_cap
from waterwave_hpo.host import trial_attr

if TYPE_CHECKING:
    from waterwave_hpo.executor._executor import WaterwaveExecutor

# The executor's own messages (OOM re-runs, lost hosts). No handler of its own: when the
# application has not configured logging, Python's last-resort handler prints WARNING and above
# to stderr, so they are visible by default; a configured root logger receives them instead.
_logger = logging.getLogger("waterwave_hpo")

ObjectiveFunc = Callable[[optuna.trial.Trial], Any] | BatchedObjective[Any]
"""An objective taking one trial, or a batched one (``fuse=K``) taking a list of trials."""
Callback = Callable[[optuna.Study, FrozenTrial], None]

_POLL_S = 0.05
_SHUTDOWN_GRACE_S = 5.0


@dataclass
class _RetryRequest:
    params: dict[str, Any]
    retry_of: int
    attempt: int
    max_running: int | None
    """Run only on a host with at most this many trials running (fewer neighbours than at OOM);
    ``None``: on any host (a re-run after its host was lost)."""
    enqueued: bool = False
    """Whether its parameters are in the study's queue (``study.enqueue_trial``) already."""
    plan_cap_bytes: int | None = None
    """With ``memory_plan="home"``: the re-run's memory plan may use at most this many bytes
    (it then runs beside any number of neighbours)."""


class OptimizeRun:
    """The state of one ``optimize`` call; lives in the calling thread."""

    def __init__(
        self,
        executor: WaterwaveExecutor,
        settings: RunSettings,
        n_trials: int | None,
        timeout_s: float | None,
        callbacks: list[Callback],
        show_progress_bar: bool,
        time_start: float | None = None,
    ) -> None:
        # As Study.optimize: the timeout counts from the call (time.monotonic() then), so the
        # hosts' start-up (worker processes, Ray actors) is part of it.
        self.time_start = time.monotonic() if time_start is None else time_start
        self.settings = settings
        self.study = settings.study
        self.n_trials = n_trials
        self.timeout_s = timeout_s
        self.callbacks = callbacks
        # The first round of asks (one per idle slot) checks the timeout as of the call when the
        # hosts were up already (threads, warm workers), as Study.optimize's threads check it as
        # they start: optimize(timeout=0.01) runs a trial per slot there, whatever the run's own
        # set-up took. Hosts that had to start (worker processes, Ray actors) count their
        # start-up; every later ask checks the clock.
        self.first_round = executor._hosts_up()
        self.hosts = executor._make_hosts(settings)
        self.hosts_ready_s = time.monotonic() - self.time_start
        self.n_started = 0  # new trials started (not counting OOM re-runs)
        self.retries: deque[_RetryRequest] = deque()
        # Running OOM re-runs -> the most trials their host may run while they do (the
        # re-run and the neighbours it may have): fresh trials must not fill the slots it
        # needed free once it started.
        self.rerun_limits: dict[int, int] = {}
        self.error: BaseException | None = None  # first fatal error, re-raised at the end
        self.stopping = False
        self.progress = _optuna_compat.progress_bar(show_progress_bar, n_trials, timeout_s)
        self.asked: list[optuna.trial.Trial] = []  # asked, not yet handed to a slot
        # One heartbeat per running trial, wherever it runs (a local slot or a Ray host): this
        # process records them while it holds the trial; if it dies they stop, and another
        # process's fail_stale_trials fails the trial (RDBStorage(heartbeat_interval=...)).
        self.heartbeats: dict[int, _optuna_compat.Heartbeat] = {}
        self.aborted: list[optuna.trial.Trial] = []  # running when optimize was interrupted
        self.fuse = executor.fuse  # None: one trial per slot; K: batches of up to K trials
        # A fused batch's slot is free once every member's outcome is handled: id(batch job)
        # -> the numbers of its trials whose outcome has not been handled yet.
        self.batch_pending: dict[int, set[int]] = {}
        self.asked_numbers: set[int] = set()  # every trial this run asked for
        # Reseed the driver's sampler before every ask (its trials sample here), or only
        # before the first (every host samples with a copy of its own: worker processes).
        self.reseed_each_ask = any(getattr(host, "samples_in_driver", True) for host in self.hosts)
        self.told_numbers: set[int] = set()  # those whose end the storage recorded
        # The storage's error when it refused to record a trial's end (the trial stays RUNNING):
        # no new trial is asked for after it, and optimize raises a StorageWriteError.
        self.storage_refusal: BaseException | None = None
        self.ctrl_c = CtrlC()
        # An interrupted run's clean-up: Optuna's "Skipped telling" lines kept quiet until
        # the slots have stopped (their own tells race the run's).
        self.quiet = contextlib.ExitStack()
        self.failed_on_abort: set[int] = set()  # aborted trials the abort told FAIL

    # -- the loop -------------------------------------------------------------------------

    def execute(self) -> None:
        study = self.study
        _optuna_compat.reset_stop(study)
        _optuna_compat.set_in_optimize_loop(study, True)
        with self.ctrl_c:
            try:
                self._loop()
                # Once more at the end: trials of a dead process whose heartbeat went stale
                # while this run lasted are failed even if no ask() came after (a short resume).
                _optuna_compat.fail_stale_trials(study, force=True)
                self._warn_if_timed_out_at_start()
            except BaseException as interrupt:  # Ctrl+C, or the executor's own bug: lose nothing
                self.ctrl_c.shield()  # no further Ctrl+C cuts the tells below
                self.quiet.enter_context(_optuna_compat.quiet_skipped_tells())
                release_interrupted_frames(interrupt)
                self._abort(interrupt)
                if isinstance(interrupt, Exception) and is_storage_error(interrupt):
                    # study.ask() (or the bookkeeping around it) could not write to the storage.
                    raise refused_write_error(
                        study,
                        interrupt,
                        running_trials(study, self.asked_numbers - self.told_numbers),
                        what="create or record a new trial (study.ask())",
                    ) from interrupt
                raise
            finally:
                self.ctrl_c.shield()
                with self.quiet:
                    self._close()
        if self.storage_refusal is not None:
            raise refused_write_error(
                study,
                self.storage_refusal,
                running_trials(study, self.asked_numbers - self.told_numbers),
                what="record a trial's end",
            ) from self.storage_refusal
        if self.error is not None:
            raise self.error

    def _warn_if_timed_out_at_start(self) -> None:
        if (
            self.timeout_s is not None
            and self.n_trials != 0
            and not self.asked_numbers
            and self.hosts_ready_s >= self.timeout_s
        ):
            _logger.warning(
                "optimize(timeout=%g) started no trial: the timeout counts from the call, as "
                "Study.optimize's does, and the device hosts took %.1f s to start. An "
                "executor with isolation='process' keeps its workers for its next optimize "
                "call; or pass a longer timeout.",
                self.timeout_s,
                self.hosts_ready_s,
            )

    def _close(self) -> None:
        """Stop the hosts and heartbeats; tell FAIL what the abort could not tell."""
        self.progress.close()
        deadline = time.monotonic() + _SHUTDOWN_GRACE_S
        for host in self.hosts:
            host.shutdown(timeout_s=max(0.0, deadline - time.monotonic()))
        for number in list(self.heartbeats):
            self._stop_heartbeat(number)
        # Once the slots have stopped (and released their storage sessions), tell FAIL again
        # whatever the abort could not (a storage locked by an interrupted thread).
        if self.aborted:
            # What the interrupted trials' frames held, in reference cycles (a storage cursor
            # holding SQLite's lock): freed once, now that their threads have ended, so that
            # no later write of this process waits for it.
            gc.collect()
        for trial in self.aborted:
            if trial.number not in self.failed_on_abort:
                _fail_quietly(self.settings, trial, "optimize() was interrupted")
        _optuna_compat.set_in_optimize_loop(self.study, False)

    def _loop(self) -> None:
        # In a function of its own: CPython 3.11 can raise a pending KeyboardInterrupt on a loop's
        # backward jump outside the enclosing try block of the same frame, escaping the handler.
        while True:
            self._dispatch()
            self.first_round = False
            if not self._running() and not self._may_start():
                return
            with self.ctrl_c.interruptible():  # Ctrl+C lands here, never in a storage call
                try:
                    outcome = self.settings.outcomes.get(timeout=_POLL_S)
                except queue.Empty:
                    outcome = None
            if outcome is not None:
                self._handle(outcome)

    def _running(self) -> int:
        return sum(host.n_running for host in self.hosts)

    def _may_start(self) -> bool:
        if self.stopping or self.error is not None:
            return False
        if _optuna_compat.stop_requested(self.study):
            return False
        if self.timeout_s is not None:
            elapsed = 0.0 if self.first_round else time.monotonic() - self.time_start
            if elapsed >= self.timeout_s:
                return False
        if self.retries:
            return True
        return self.n_trials is None or self.n_started < self.n_trials

    def _dispatch(self) -> None:
        while self._may_start():
            if self.retries:
                # A pending re-run goes first, on a host with few enough trials running; fresh
                # trials wait behind it so it cannot starve.
                request = self.retries[0]
                host = self._host_for(max_running=request.max_running)
                if host is None:
                    return
                if not self._enqueue(request):
                    continue
            else:
                host = self._host_for(max_running=None)
                if host is None:
                    return
            _optuna_compat.fail_stale_trials(self.study)  # as Study.optimize, before ask()
            self._ask_and_submit(host)

    def _ask_and_submit(self, host: HostHandle[Any]) -> None:
        slot = host.idle_slot()
        assert slot is not None
        jobs = [self._ask_job()]
        if self.fuse is None:
            job = jobs[0]
        else:
            # Up to `fuse` trials, each asked as Study.optimize would (n_trials, timeout,
            # study.stop()); a re-run after a fused batch ran out of memory runs alone.
            while (
                len(jobs) < self.fuse
                and jobs[0].attempt == 0
                and not self.retries
                and self._may_start()
            ):
                jobs.append(self._ask_job())
            # The batch is one attempt: its trials share one memory planning (a fused
            # model registered with fit_trial_memory is planned as one).
            planning = jobs[0].planning
            for member in jobs:
                member.planning = planning
            job = TrialJob(
                jobs[0].trial, jobs[0].attempt, jobs[0].retry_of, planning, batch=tuple(jobs)
            )
            self.batch_pending[id(job)] = {member.trial.number for member in jobs}
        host.submit(slot, job)
        self.asked.clear()

    def _ask_job(self) -> TrialJob:
        """Ask the study for one trial, start its heartbeat and count it.

        The trial stays in ``self.asked`` until the caller hands it to a slot. With several
        trials at once (more than one slot, or fused batches), the sampler's RNG is reseeded
        before each ask, as ``Study.optimize`` does for each trial of ``n_jobs != 1``; once,
        before the run's first ask, when every host samples in a process of its own (worker
        processes: each reseeds its copy as it opens the run, and this process's sampler only
        sees ``before_trial`` and ``after_trial``).
        """
        if self._concurrent() and (self.reseed_each_ask or not self.asked_numbers):
            self.study.sampler.reseed_rng()
        trial = self.study.ask()
        self.asked.append(trial)  # (failed by _abort if the heartbeat cannot be written)
        self.asked_numbers.add(trial.number)
        # The first heartbeat before anything else: a process that dies from here on leaves a
        # trial the next process's fail_stale_trials fails. Dying between ask() and this
        # write leaves a trial without heartbeat, which that sweep fails after the grace period.
        _optuna_compat.record_heartbeat(self.study, _optuna_compat.trial_id(trial))
        beat = _optuna_compat.heartbeat(self.study, _optuna_compat.trial_id(trial))
        beat.start()
        self.heartbeats[trial.number] = beat
        attrs = _optuna_compat.system_attrs(self.study, _optuna_compat.trial_id(trial))
        attempt = int(attrs.get(ATTR_ATTEMPT, 0))  # type: ignore[call-overload]
        retry_of = attrs.get(ATTR_RETRY_OF)
        cap = attrs.get(ATTR_PLAN_CAP)
        planning = (
            None
            if self.settings.memory_plan.mode is MemoryPlanMode.OFF
            else TrialPlanning(
                self.settings.memory_plan,
                cap_bytes=None if cap is None else int(cap),  # type: ignore[call-overload]
            )
        )
        if attempt == 0:
            # A new trial, sampled or enqueued by the user (ask() pops the oldest WAITING
            # trial, which may be older than a re-run we enqueued; that one comes next).
            self.n_started += 1
        else:
            for request in list(self.retries):
                if (request.retry_of, request.attempt) == (retry_of, attempt):
                    self.retries.remove(request)
                    if request.max_running is not None:
                        self.rerun_limits[trial.number] = request.max_running + 1
        retry_number = None if retry_of is None else int(retry_of)  # type: ignore[call-overload]
        return TrialJob(trial, attempt, retry_number, planning)

    def _concurrent(self) -> bool:
        """Whether trials may run at once: more than one slot in all, or fused batches."""
        return (self.fuse or 1) > 1 or sum(len(host.slots) for host in self.hosts) > 1

    def _enqueue(self, request: _RetryRequest) -> bool:
        """Put ``request``'s parameters in the study's queue, once.

        Returns ``False`` (and forgets the request) when it was enqueued before and is no longer
        waiting: another process sharing the study took it and runs it.
        """
        if not request.enqueued:
            attrs: dict[str, Any] = {ATTR_RETRY_OF: request.retry_of, ATTR_ATTEMPT: request.attempt}
            if request.plan_cap_bytes is not None:
                attrs[ATTR_PLAN_CAP] = request.plan_cap_bytes
            _optuna_compat.enqueue_with_system_attrs(self.study, request.params, attrs)
            request.enqueued = True
            return True
        waiting = self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        if any(
            (trial_attr(t, ATTR_RETRY_OF), trial_attr(t, ATTR_ATTEMPT))
            == (request.retry_of, request.attempt)
            for t in waiting
        ):
            return True
        self.retries.remove(request)
        return False

    def _host_for(self, max_running: int | None) -> HostHandle[Any] | None:
        # The host with the most room: fewest running trials among those with an idle slot,
        # and below the limit of any OOM re-run it runs.
        candidates = [
            host
            for host in self.hosts
            if host.idle_slot() is not None
            and (max_running is None or host.n_running <= max_running)
            and host.n_running < self._rerun_limit(host)
        ]
        if not candidates:
            return None
        return min(candidates, key=lambda host: host.n_running)

    def _rerun_limit(self, host: HostHandle[Any]) -> float:
        """The most trials ``host`` may run while its OOM re-runs run (inf without any)."""
        limits = [
            self.rerun_limits[slot.job.trial.number]
            for slot in host.slots
            if slot.job is not None and slot.job.trial.number in self.rerun_limits
        ]
        return min(limits, default=float("inf"))

    def _handle(self, outcome: TrialOutcome) -> None:
        self.rerun_limits.pop(outcome.job.trial.number, None)
        for host in self.hosts:
            for slot in host.slots:
                if slot.job is outcome.job:
                    slot.job = None
                    host.memory.trial_ended(outcome.job.trial.number)
                elif slot.job is not None and any(m is outcome.job for m in slot.job.batch):
                    host.memory.trial_ended(outcome.job.trial.number)
                    pending = self.batch_pending[id(slot.job)]
                    pending.discard(outcome.job.trial.number)
                    if not pending:  # every trial of the fused batch handled: the slot is free
                        del self.batch_pending[id(slot.job)]
                        slot.job = None
        frozen = outcome.frozen_trial
        kind = outcome.kind
        number = outcome.job.trial.number
        if frozen is not None and frozen.state.is_finished():
            self.told_numbers.add(number)
        self._stop_heartbeat(number)
        if kind is OutcomeKind.INTERRUPTED:
            return
        if kind in (OutcomeKind.OOM_RETRY, OutcomeKind.HOST_LOST):
            # A remote host's trial object never saw its suggestions; the told trial has them.
            params = frozen.params if frozen is not None else outcome.job.trial.params
            cap = planned_rerun_cap(outcome.job) if kind is OutcomeKind.OOM_RETRY else None
            request = _RetryRequest(
                params=dict(params),
                retry_of=number if outcome.job.retry_of is None else int(outcome.job.retry_of),
                attempt=outcome.job.attempt + 1,
                max_running=(
                    max(0, outcome.neighbours - 1)
                    if kind is OutcomeKind.OOM_RETRY and cap is None
                    else None
                ),
                plan_cap_bytes=cap,
            )
            self.retries.append(request)
            if kind is OutcomeKind.HOST_LOST:
                _logger.warning(
                    "Trial %d was running on a device host that was lost; its parameters are "
                    "re-queued (attempt %d) on the remaining hosts.",
                    number,
                    request.attempt,
                )
            elif cap is not None:
                _logger.warning(
                    "Trial %d ran out of device memory beside %d other trial(s); its "
                    "parameters are re-queued (attempt %d of %d) to run at once with a memory "
                    "plan for at most %d bytes.",
                    number,
                    outcome.neighbours,
                    request.attempt,
                    self.settings.max_oom_retries,
                    cap,
                )
            else:
                _logger.warning(
                    "Trial %d ran out of device memory beside %d other trial(s); its "
                    "parameters are re-queued (attempt %d of %d) to run with at most %d "
                    "neighbour(s).",
                    number,
                    outcome.neighbours,
                    request.attempt,
                    self.settings.max_oom_retries,
                    request.max_running,
                )
        else:
            self._log(outcome)
        if kind is OutcomeKind.FATAL and self.error is None:
            self.error = outcome.error
        if (
            kind is OutcomeKind.FATAL
            and frozen is None
            and outcome.error is not None
            and is_storage_error(outcome.error)
            and self.storage_refusal is None
        ):
            # Not even FAIL could be written: the trial stays RUNNING in the storage.
            self.storage_refusal = outcome.error
        if frozen is not None and kind is not OutcomeKind.FATAL:
            # Optuna's rule: no callback for a trial whose exception propagates.
            for callback in self.callbacks:
                try:
                    with self.ctrl_c.interruptible():  # the user's code, as under Study.optimize
                        callback(self.study, frozen)
                except KeyboardInterrupt:
                    raise
                except BaseException as error:
                    if self.error is None:
                        self.error = error
                    self.stopping = True
                    break
        if kind not in (OutcomeKind.OOM_RETRY, OutcomeKind.HOST_LOST):
            self.progress.update(time.monotonic() - self.time_start, self.study)

    def _stop_heartbeat(self, number: int) -> None:
        beat = self.heartbeats.pop(number, None)
        if beat is not None:
            beat.join()

    def _abort(self, interrupt: BaseException) -> None:
        # Tell every running trial FAIL first (nothing may be left RUNNING), then stop threads.
        self.stopping = True
        reason = f"optimize() was interrupted: {type(interrupt).__name__}"
        running = [pair for host in self.hosts for pair in host.running_jobs()]
        batches = [job.members() for _, job in running]
        # The fused batches' reasons before the first FAIL: once a trial is told FAIL, a
        # batch-mate still running raises at its next report() (the storage refuses the write)
        # and its host tells the mate FAIL with that error unless a reason is already there.
        for members in batches:
            if len(members) > 1:
                for member in members:
                    with contextlib.suppress(Exception):
                        if not _optuna_compat.is_finished(self.settings.study, member.trial):
                            _write_reason(self.settings, member.trial, reason)
        for trial in [*self.asked, *(member.trial for members in batches for member in members)]:
            self._fail_aborted(trial, reason)
        # Only then stop them: an objective that writes to its trial stops by itself now (the
        # storage refuses the write), and one interrupted inside a storage call can no longer
        # hold up the tells above (its cursor keeps SQLite's lock until its thread frees it).
        for slot, _ in running:
            slot.interrupt()
        # Trials told COMPLETE/PRUNED meanwhile still reach their callbacks' state in storage;
        # drain what has already been reported, without waiting for the rest.
        with contextlib.suppress(queue.Empty):
            while True:
                self.settings.outcomes.get_nowait()
        if self.aborted:
            numbers = ", ".join(str(trial.number) for trial in self.aborted)
            _logger.warning(
                "optimize() was interrupted (%s): the %d trial(s) it was running (%s) are told "
                "FAIL.",
                type(interrupt).__name__,
                len(self.aborted),
                numbers,
            )

    def _fail_aborted(self, trial: optuna.trial.Trial, reason: str) -> None:
        self.aborted.append(trial)
        if _fail_quietly(self.settings, trial, reason):
            self.failed_on_abort.add(trial.number)

    # -- reporting ------------------------------------------------------------------------

    def _log(self, outcome: TrialOutcome) -> None:
        # Optuna's lines on Optuna's loggers, as Study.optimize logs them.
        if outcome.frozen_trial is None:
            return
        _optuna_compat.log_finished_trial(
            self.study, outcome.frozen_trial, outcome.error, outcome.fail_message
        )


def _write_reason(settings: RunSettings, trial: optuna.trial.Trial, reason: str) -> None:
    """Record ``reason`` as ``trial``'s fail reason (if the run records attrs); never raises."""
    if settings.record_trial_attrs:
        with contextlib.suppress(Exception):
            _optuna_compat.set_system_attr(
                settings.study, _optuna_compat.trial_id(trial), ATTR_FAIL_REASON, reason
            )


def _fail_quietly(settings: RunSettings, trial: optuna.trial.Trial, reason: str) -> bool:
    """Tell ``trial`` FAIL with ``reason`` unless it has ended; never raises.

    Returns:
        Whether the trial has ended in the storage now (told here or before).
    """
    study = settings.study
    try:
        if _optuna_compat.is_finished(study, trial):
            return True  # ended meanwhile: no "Skipped telling" line of Optuna's
        _write_reason(settings, trial, reason)
        study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
    except Exception:
        return False
    return True
