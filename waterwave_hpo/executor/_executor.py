"""``WaterwaveExecutor``: run an Optuna study's trials several at a time on each device."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Sequence
import contextlib
from dataclasses import dataclass
import logging
import queue
import signal
import threading
import time
from typing import Any

import optuna
from optuna.trial import FrozenTrial
from optuna.trial import TrialState
import torch

from waterwave_hpo import _checks
from waterwave_hpo import _optuna_compat
from waterwave_hpo.executor._attrs import ATTR_ATTEMPT
from waterwave_hpo.executor._attrs import ATTR_FAIL_REASON
from waterwave_hpo.executor._attrs import ATTR_RETRY_OF
from waterwave_hpo.executor._attrs import trial_attr
from waterwave_hpo.executor._devices import DeviceSpec
from waterwave_hpo.executor._devices import resolve_devices
from waterwave_hpo.executor._host import DeviceHost
from waterwave_hpo.executor._host import RunSettings
from waterwave_hpo.executor._host_protocol import Host
from waterwave_hpo.executor._memory import DeviceMemory
from waterwave_hpo.executor._memory import MemoryPoolMode
from waterwave_hpo.executor._memory import make_device_memory
from waterwave_hpo.executor._outcome import OnOOM
from waterwave_hpo.executor._outcome import OutcomeKind
from waterwave_hpo.executor._outcome import TrialJob
from waterwave_hpo.executor._outcome import TrialOutcome
from waterwave_hpo.scheduler import PipelineScheduler
from waterwave_hpo.scheduler import Policy
from waterwave_hpo.scheduler import PolicyName
from waterwave_hpo.scheduler import make_policy
from waterwave_hpo.sim import PackingPrediction

# The executor's own messages (OOM re-runs, lost hosts). No handler of its own: when the
# application has not configured logging, Python's last-resort handler prints WARNING and above
# to stderr, so they are visible by default; a configured root logger receives them instead.
_logger = logging.getLogger("waterwave_hpo")

ObjectiveFunc = Callable[[optuna.trial.Trial], Any]
Callback = Callable[[optuna.Study, FrozenTrial], None]

_POLL_S = 0.05
_SHUTDOWN_GRACE_S = 5.0


class WaterwaveExecutor:
    """Run an Optuna study's trials concurrently, several per device, in one process.

    Each device gets a host with ``trials_per_device`` slots; each slot is a thread with its own
    CUDA stream (current in that thread), so co-hosted trials overlap on the GPU as in Waterwave
    (IEEE TC 2023, Sec. 3). On a CPU-only machine the same code runs trials concurrently on the
    CPU. Trials are driven with ``study.ask()``/``study.tell()``, so any ``optuna.Study`` works:
    its sampler, pruner and storage are used as they are.

    Every trial it asks for ends in the study as COMPLETE, PRUNED or FAIL, whatever happens to
    its neighbours: ``optuna.TrialPruned`` prunes it; an exception listed in ``catch`` fails it
    alone; any other exception fails it, lets the running trials finish and be told, then
    propagates from :meth:`optimize` (Optuna's semantics); running out of device memory fails
    it alone or re-queues its parameters (``on_oom``); Ctrl+C tells every running trial FAIL
    before ``KeyboardInterrupt`` propagates.

    As ``Study.optimize``: finished trials are logged on Optuna's logger with Optuna's words;
    with ``RDBStorage(heartbeat_interval=...)`` this process records a heartbeat for each trial
    it runs (on a local slot or a Ray host) and fails stale trials (running the storage's
    stale-trial callback, e.g. a retry) before each ``ask()``, so a crashed process's trials end
    FAIL. ``sqlite:///:memory:`` is refused: SQLite keeps such a database per connection.

    Args:
        devices: ``"auto"`` (every visible CUDA device, else the CPU), ``"cpu"``, ``"cuda"``
            (every visible CUDA device), ``"cuda:N"``, an int ``N``, a ``torch.device``, or a
            list of them.
        trials_per_device: How many trials run at once on each device (>= 1), or ``"auto"``:
            up to ``max_trials_per_device``, starting another trial only while the device's
            measured memory demand leaves room (on CUDA, the running trials' peaks in the pool
            plus the median peak of finished ones; with NodeGroup gates, their profiles fitting
            the pipeline scheduler's budget, and no more trials than the simulator predicts is
            fastest for the largest profile seen, see :attr:`packing_predictions`). ``"auto"``
            needs something to measure: CUDA, or
            ``memory_budget_bytes`` with :func:`waterwave_hpo.pipeline` in the objective;
            otherwise trials run one at a time.
        on_oom: ``"retry"`` (default): a trial that runs out of device memory while it had
            neighbours is told FAIL and its parameters are enqueued again
            (``study.enqueue_trial``), to run once fewer trials share its device; at most
            ``max_oom_retries`` times. ``"fail"``: it is told FAIL. Either way the others go on.
        max_oom_retries: How many times one set of parameters is re-queued after OOM (>= 0).
        memory_budget_bytes: Bytes each device's pipeline scheduler may hand to NodeGroups
            (> 0). ``None``: on CUDA, the device's total memory less a reserve for the CUDA
            context and libraries (``executor._memory.default_budget_bytes``), or the pool's
            capacity if smaller; on the CPU, no scheduler (NodeGroup gates pass through).
        policy: The pipeline scheduler's policy: ``"waterwave"`` (NodeGroup pipeline, default)
            or ``"fifo"``, or a :class:`waterwave_hpo.scheduler.Policy`.
        memory_pool: ``"auto"`` (default): on CUDA, make the stream-aware pool PyTorch's
            allocator if PyTorch has not allocated on CUDA yet in this process (otherwise warn
            and keep PyTorch's), one account per trial; ``"on"``: the same, but raise instead
            of falling back; ``"off"``: PyTorch's allocator.
        max_trials_per_device: The cap for ``trials_per_device="auto"`` (>= 1).
        record_trial_attrs: Record where and how each trial ran as system attributes of the
            trial (``waterwave:device``, ``waterwave:slot``, ``waterwave:peak_bytes``,
            ``waterwave:fail_reason``; read them with
            ``waterwave_hpo.executor.trial_attr``), which ``waterwave_hpo.report``'s trials
            table and timeline show. Off by default, so a study's trials look as
            ``Study.optimize`` leaves them (``trials_dataframe()`` has Optuna's columns). The
            user's ``user_attrs`` are never touched. A re-run after an out-of-memory error
            always records ``waterwave:retry_of`` and ``waterwave:attempt``.

    Raises:
        ValueError: For an argument out of range or a device that does not exist; the message
            names the argument, the value and the fix.
        TypeError: For an argument of the wrong type.

    Example::

        import waterwave_hpo as ww

        study = ww.create_study(direction="maximize")
        study.optimize(objective, n_trials=64, executor=ww.WaterwaveExecutor(trials_per_device=4))
    """

    def __init__(
        self,
        devices: DeviceSpec | Sequence[DeviceSpec] = "auto",
        trials_per_device: int | str = 4,
        *,
        on_oom: OnOOM | str = OnOOM.RETRY,
        max_oom_retries: int = 2,
        memory_budget_bytes: int | None = None,
        policy: str | PolicyName | Policy = PolicyName.WATERWAVE,
        memory_pool: MemoryPoolMode | str = MemoryPoolMode.AUTO,
        max_trials_per_device: int = 16,
        record_trial_attrs: bool = False,
    ) -> None:
        self.devices: list[torch.device] = resolve_devices(devices)
        self._init_trial_settings(
            trials_per_device,
            on_oom=on_oom,
            max_oom_retries=max_oom_retries,
            memory_budget_bytes=memory_budget_bytes,
            policy=policy,
            memory_pool=memory_pool,
            max_trials_per_device=max_trials_per_device,
            record_trial_attrs=record_trial_attrs,
        )

    def _init_trial_settings(
        self,
        trials_per_device: int | str,
        *,
        on_oom: OnOOM | str,
        max_oom_retries: int,
        memory_budget_bytes: int | None,
        policy: str | PolicyName | Policy,
        memory_pool: MemoryPoolMode | str,
        max_trials_per_device: int,
        record_trial_attrs: bool,
    ) -> None:
        """Check and keep the settings every host applies (all but the devices, which a
        subclass with remote hosts does not resolve here); the arguments are ``__init__``'s.

        Raises:
            TypeError: For an argument of the wrong type.
            ValueError: For an argument out of range.
        """
        if not isinstance(record_trial_attrs, bool):
            raise _checks.type_error(
                "record_trial_attrs", record_trial_attrs, "a bool", "pass True or False"
            )
        self.record_trial_attrs = record_trial_attrs
        self.max_trials_per_device = _check_positive_int(
            "max_trials_per_device", max_trials_per_device, 1
        )
        self.auto_trials = trials_per_device == "auto"
        if isinstance(trials_per_device, str) and not self.auto_trials:
            raise _checks.type_error(
                "trials_per_device", trials_per_device, "an int >= 1 or 'auto'", "pass e.g. 4"
            )
        self.trials_per_device = (
            self.max_trials_per_device
            if self.auto_trials
            else _check_positive_int("trials_per_device", trials_per_device, 1)
        )
        self.on_oom = _check_on_oom(on_oom)
        self.max_oom_retries = _check_positive_int("max_oom_retries", max_oom_retries, 0)
        self.memory_budget_bytes = (
            None
            if memory_budget_bytes is None
            else _check_positive_int("memory_budget_bytes", memory_budget_bytes, 1)
        )
        self.policy = policy
        self._schedulers: dict[str, PipelineScheduler] = {}
        self._memories: dict[str, DeviceMemory] = {}
        if not isinstance(policy, Policy):
            make_policy(policy)  # a bad name fails here, before any trial
        try:
            self.memory_pool = MemoryPoolMode(memory_pool)
        except ValueError:
            raise _checks.value_error(
                "memory_pool", memory_pool, "is not one of 'auto', 'on', 'off'", "pass 'auto'"
            ) from None

    def _make_hosts(self, settings: RunSettings) -> Sequence[Host[Any]]:
        """The device hosts of one ``optimize`` call (a subclass may return other
        :class:`Host` implementations, e.g. :class:`waterwave_hpo.cluster.RayExecutor`'s remote
        hosts). The loop reads the returned list on every turn, so a subclass may append hosts
        to it later from another thread (a host that joins mid-study)."""
        return [
            DeviceHost(
                device,
                self.trials_per_device,
                settings,
                memory=make_device_memory(
                    device,
                    self.memory_pool,
                    self.memory_budget_bytes,
                    self.policy,
                    max_trials=self.trials_per_device,
                ),
                admit_by_memory=self.auto_trials,
            )
            for device in self.devices
        ]

    @property
    def schedulers(self) -> dict[str, PipelineScheduler]:
        """The pipeline scheduler of each device (``"cpu"``, ``"cuda:0"``, ...) of the most
        recent :meth:`optimize` call, for their ``stats()``; devices without one are left out."""
        return dict(self._schedulers)

    @property
    def packing_predictions(self) -> dict[str, PackingPrediction]:
        """What ``trials_per_device="auto"`` follows on each device (``"cpu"``, ``"cuda:0"``,
        ...) in the most recent :meth:`optimize` call: the simulator's best number of trials at
        once for the largest NodeGroup profile seen there
        (:func:`waterwave_hpo.sim.predict_auto_packing`). Devices with no prediction yet (no
        gates declared a profile, no scheduler, or a fixed ``trials_per_device``) are left out."""
        predictions = {name: memory.packing for name, memory in self._memories.items()}
        return {name: p for name, p in predictions.items() if p is not None}

    def __repr__(self) -> str:
        devices = ", ".join(str(device) for device in self.devices)
        return (
            f"WaterwaveExecutor(devices=[{devices}], trials_per_device="
            f"{'auto' if self.auto_trials else self.trials_per_device}, "
            f"on_oom={self.on_oom.value!r}, max_oom_retries={self.max_oom_retries}, "
            f"memory_budget_bytes={self.memory_budget_bytes}, "
            f"memory_pool={self.memory_pool.value!r})"
        )

    def optimize(
        self,
        study: optuna.Study,
        func: ObjectiveFunc,
        n_trials: int | None = None,
        timeout: float | None = None,
        catch: Iterable[type[Exception]] | type[Exception] = (),
        callbacks: Iterable[Callback] | None = None,
        gc_after_trial: bool = False,
        show_progress_bar: bool = False,
    ) -> None:
        """Optimize ``func`` on ``study``, running trials concurrently on the devices.

        The arguments mean what they mean for ``optuna.Study.optimize``.

        Args:
            study: Any ``optuna.Study``.
            func: The objective: takes an ``optuna.trial.Trial``, returns a float (or a sequence
                of floats for a multi-objective study). Inside it, :func:`waterwave_hpo.current`
                gives the trial's device and stream.
            n_trials: How many new trials to run (>= 0); ``None`` for no limit. Re-runs of
                parameters after an out-of-memory error do not count.
            timeout: Stop starting trials after this many seconds (> 0); running trials finish.
                ``None`` for no limit.
            catch: Exception types that fail only their trial; the study goes on.
            callbacks: Called as ``callback(study, frozen_trial)`` after each trial is told, in
                the thread that called ``optimize``, one at a time; not for a trial whose
                exception propagates (Optuna's rule). ``study.stop()`` works there and in
                objectives: no trial is asked for after it; the trials running at that moment
                (up to ``trials_per_device`` per device) still finish, are told and reach the
                callbacks. So ``MaxTrialsCallback(n)`` may end with up to
                ``n + trials_per_device * len(devices) - 1`` trials in the state it counts.
            gc_after_trial: Run ``gc.collect()`` after each trial.
            show_progress_bar: Show Optuna's progress bar: finished trials of ``n_trials``, or
                with only a ``timeout`` the elapsed time; with neither, Optuna's warning.

        Raises:
            TypeError: If ``study``, ``func``, ``catch`` or ``callbacks`` has the wrong type.
            ValueError: If ``n_trials`` or ``timeout`` is out of range, or the study's storage
                is an in-memory SQLite database (``sqlite:///:memory:``).
            RuntimeError: If called inside another ``optimize`` of the same study.
            Exception: The first exception an objective raised that is not in ``catch``, after
                the other running trials have finished and been told.
            KeyboardInterrupt: On Ctrl+C, after every running trial has been told FAIL.
        """
        if not isinstance(study, optuna.Study):
            raise _checks.type_error(
                "study",
                study,
                "an optuna.Study",
                "create one with waterwave_hpo.create_study(...) or optuna.create_study(...)",
            )
        if not callable(func):
            raise _checks.type_error(
                "func", func, "callable", "pass the objective, a function taking a trial"
            )
        if n_trials is not None:
            n_trials = _check_positive_int("n_trials", n_trials, 0)
        if timeout is not None:
            _checks.check_number(
                "timeout", timeout, fix="pass seconds > 0, or None for no time limit"
            )
        catch_tuple = _check_catch(catch)
        callback_list = _check_callbacks(callbacks)
        if _optuna_compat.in_optimize_loop(study):
            raise RuntimeError("Nested invocation of `Study.optimize` method isn't allowed.")
        memory_url = _optuna_compat.in_memory_sqlite_url(study)
        if memory_url is not None:
            raise ValueError(
                f"study's storage {memory_url!r} is an in-memory SQLite database, which SQLite "
                "keeps per connection: trials told from the executor's threads would be lost "
                "and left RUNNING. Use a file (storage='sqlite:///study.db'), "
                "optuna.storages.InMemoryStorage() (storage=None), or a journal file."
            )

        run = _OptimizeRun(
            executor=self,
            settings=RunSettings(
                study=study,
                func=func,
                catch=catch_tuple,
                on_oom=self.on_oom,
                max_oom_retries=self.max_oom_retries,
                gc_after_trial=bool(gc_after_trial),
                outcomes=queue.SimpleQueue(),
                record_trial_attrs=self.record_trial_attrs,
            ),
            n_trials=n_trials,
            timeout_s=None if timeout is None else float(timeout),
            callbacks=callback_list,
            show_progress_bar=bool(show_progress_bar),
        )
        executor_schedulers = {
            str(host.device): host.scheduler for host in run.hosts if host.scheduler is not None
        }
        self._schedulers = executor_schedulers
        self._memories = {
            str(host.device): memory
            for host in run.hosts
            if isinstance(memory := host.memory, DeviceMemory)
        }
        run.execute()


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


class _OptimizeRun:
    """The state of one ``optimize`` call; lives in the calling thread."""

    def __init__(
        self,
        executor: WaterwaveExecutor,
        settings: RunSettings,
        n_trials: int | None,
        timeout_s: float | None,
        callbacks: list[Callback],
        show_progress_bar: bool,
    ) -> None:
        self.settings = settings
        self.study = settings.study
        self.n_trials = n_trials
        self.timeout_s = timeout_s
        self.callbacks = callbacks
        self.hosts = executor._make_hosts(settings)
        self.n_started = 0  # new trials started (not counting OOM re-runs)
        self.retries: deque[_RetryRequest] = deque()
        self.error: BaseException | None = None  # first fatal error, re-raised at the end
        self.stopping = False
        self.progress = _optuna_compat.progress_bar(show_progress_bar, n_trials, timeout_s)
        self.time_start = 0.0
        self.asked: optuna.trial.Trial | None = None  # asked, not yet handed to a slot
        # One heartbeat per running trial, wherever it runs (a local slot or a Ray host): this
        # process records them while it holds the trial; if it dies they stop, and another
        # process's fail_stale_trials fails the trial (RDBStorage(heartbeat_interval=...)).
        self.heartbeats: dict[int, _optuna_compat.Heartbeat] = {}
        self.aborted: list[optuna.trial.Trial] = []  # running when optimize was interrupted

    # -- the loop -------------------------------------------------------------------------

    def execute(self) -> None:
        study = self.study
        _optuna_compat.reset_stop(study)
        _optuna_compat.set_in_optimize_loop(study, True)
        self.time_start = time.monotonic()
        try:
            self._loop()
        except BaseException as interrupt:  # Ctrl+C, or the executor's own bug: lose nothing
            self._abort(interrupt)
            raise
        finally:
            self.progress.close()
            for host in self.hosts:
                host.shutdown(timeout_s=_SHUTDOWN_GRACE_S)
            for number in list(self.heartbeats):
                self._stop_heartbeat(number)
            # Once the slots have stopped (and released their storage sessions), tell FAIL
            # again whatever the abort could not (a storage locked by an interrupted thread).
            for trial in self.aborted:
                _fail_quietly(self.settings, trial, "optimize() was interrupted")
            _optuna_compat.set_in_optimize_loop(study, False)
        if self.error is not None:
            raise self.error

    def _loop(self) -> None:
        # In a function of its own: CPython 3.11 can raise a pending KeyboardInterrupt on a loop's
        # backward jump outside the enclosing try block of the same frame, escaping the handler.
        while True:
            self._dispatch()
            if not self._running() and not self._may_start():
                return
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
        if self.timeout_s is not None and time.monotonic() - self.time_start >= self.timeout_s:
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
            with _ctrl_c_deferred():
                self._ask_and_submit(host)

    def _ask_and_submit(self, host: Host[Any]) -> None:
        self.asked = trial = self.study.ask()
        beat = _optuna_compat.heartbeat(self.study, _optuna_compat.trial_id(trial))
        beat.start()
        self.heartbeats[trial.number] = beat
        attrs = _optuna_compat.system_attrs(self.study, _optuna_compat.trial_id(trial))
        attempt = int(attrs.get(ATTR_ATTEMPT, 0))  # type: ignore[call-overload]
        retry_of = attrs.get(ATTR_RETRY_OF)
        if attempt == 0:
            # A new trial, sampled or enqueued by the user (ask() pops the oldest WAITING
            # trial, which may be older than a re-run we enqueued; that one comes next).
            self.n_started += 1
        else:
            for request in list(self.retries):
                if (request.retry_of, request.attempt) == (retry_of, attempt):
                    self.retries.remove(request)
        slot = host.idle_slot()
        assert slot is not None
        retry_number = None if retry_of is None else int(retry_of)  # type: ignore[call-overload]
        host.submit(slot, TrialJob(trial, attempt, retry_number))
        self.asked = None

    def _enqueue(self, request: _RetryRequest) -> bool:
        """Put ``request``'s parameters in the study's queue, once.

        Returns ``False`` (and forgets the request) when it was enqueued before and is no longer
        waiting: another process sharing the study took it and runs it.
        """
        if not request.enqueued:
            _optuna_compat.enqueue_with_system_attrs(
                self.study,
                request.params,
                {ATTR_RETRY_OF: request.retry_of, ATTR_ATTEMPT: request.attempt},
            )
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

    def _host_for(self, max_running: int | None) -> Host[Any] | None:
        # The host with the most room: fewest running trials among those with an idle slot.
        candidates = [
            host
            for host in self.hosts
            if host.idle_slot() is not None
            and (max_running is None or host.n_running <= max_running)
        ]
        if not candidates:
            return None
        return min(candidates, key=lambda host: host.n_running)

    def _handle(self, outcome: TrialOutcome) -> None:
        for host in self.hosts:
            for slot in host.slots:
                if slot.job is outcome.job:
                    slot.job = None
                    host.memory.trial_ended(outcome.job.trial.number)
        frozen = outcome.frozen_trial
        kind = outcome.kind
        number = outcome.job.trial.number
        self._stop_heartbeat(number)
        if kind is OutcomeKind.INTERRUPTED:
            return
        if kind in (OutcomeKind.OOM_RETRY, OutcomeKind.HOST_LOST):
            # A remote host's trial object never saw its suggestions; the told trial has them.
            params = frozen.params if frozen is not None else outcome.job.trial.params
            request = _RetryRequest(
                params=dict(params),
                retry_of=number if outcome.job.retry_of is None else int(outcome.job.retry_of),
                attempt=outcome.job.attempt + 1,
                max_running=(
                    max(0, outcome.neighbours - 1) if kind is OutcomeKind.OOM_RETRY else None
                ),
            )
            self.retries.append(request)
            if kind is OutcomeKind.HOST_LOST:
                _logger.warning(
                    "Trial %d was running on a device host that was lost; its parameters are "
                    "re-queued (attempt %d) on the remaining hosts.",
                    number,
                    request.attempt,
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
        if frozen is not None and kind is not OutcomeKind.FATAL:
            # Optuna's rule: no callback for a trial whose exception propagates.
            for callback in self.callbacks:
                try:
                    callback(self.study, frozen)
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
        if self.asked is not None:
            self.aborted.append(self.asked)
            _fail_quietly(self.settings, self.asked, reason)
        for host in self.hosts:
            for slot, job in host.running_jobs():
                self.aborted.append(job.trial)
                _fail_quietly(self.settings, job.trial, reason)
                slot.interrupt()
        # Trials told COMPLETE/PRUNED meanwhile still reach their callbacks' state in storage;
        # drain what has already been reported, without waiting for the rest.
        with contextlib.suppress(queue.Empty):
            while True:
                self.settings.outcomes.get_nowait()

    # -- reporting ------------------------------------------------------------------------

    def _log(self, outcome: TrialOutcome) -> None:
        # Optuna's lines on Optuna's loggers, as Study.optimize logs them.
        if outcome.frozen_trial is None:
            return
        error = outcome.error
        _optuna_compat.log_finished_trial(
            self.study, outcome.frozen_trial, error, outcome.fail_message, outcome.value
        )


@contextlib.contextmanager
def _ctrl_c_deferred() -> Iterator[None]:
    """Hold Ctrl+C while a trial is asked for and handed to a slot, then raise it.

    A ``KeyboardInterrupt`` inside ``study.ask()`` (a slow storage: SQLite, a journal file)
    would leave the trial it just created RUNNING, known to no one. Only in the main thread,
    and only while Python's own SIGINT handler is installed (a user's handler is left alone).
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


def _fail_quietly(settings: RunSettings, trial: optuna.trial.Trial, reason: str) -> None:
    study = settings.study
    if settings.record_trial_attrs:
        with contextlib.suppress(Exception):
            _optuna_compat.set_system_attr(
                study, _optuna_compat.trial_id(trial), ATTR_FAIL_REASON, reason
            )
    with contextlib.suppress(Exception):
        study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)


def _check_positive_int(name: str, value: object, minimum: int) -> int:
    return _checks.check_int(name, value, minimum=minimum)


def _check_on_oom(value: object) -> OnOOM:
    return _checks.check_choice(
        "on_oom",
        value,
        OnOOM,
        "pass 'retry' to re-run the trial's parameters with fewer neighbours, or 'fail' to fail it",
    )


def _check_catch(catch: object) -> tuple[type[Exception], ...]:
    if isinstance(catch, type):
        items: list[object] = [catch]
    elif isinstance(catch, Iterable) and not isinstance(catch, (str, bytes)):
        items = list(catch)
    else:
        raise _checks.type_error(
            "catch",
            catch,
            "an exception type or a tuple of exception types",
            "pass e.g. catch=(ValueError,)",
        )
    for index, item in enumerate(items):
        if not (isinstance(item, type) and issubclass(item, BaseException)):
            raise _checks.type_error(
                f"catch[{index}]",
                item,
                "an exception type",
                "pass exception classes such as catch=(ValueError, RuntimeError)",
            )
    return tuple(items)  # type: ignore[arg-type]


def _check_callbacks(callbacks: object) -> list[Callback]:
    if callbacks is None:
        return []
    return _checks.check_callables("callbacks", callbacks, "(study, frozen_trial)")
