"""``WaterwaveExecutor``: run an Optuna study's trials several at a time on each device.

The public class only: its arguments, their checks and its docstrings. The loop of one
``optimize`` call is :class:`waterwave_hpo.executor._optimize.OptimizeRun`.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence
import queue
import threading
import time
from typing import Any

import optuna
import torch

from waterwave_hpo import _checks
from waterwave_hpo import _optuna_compat
from waterwave_hpo.executor._handle import HostHandle
from waterwave_hpo.executor._isolation import Isolation
from waterwave_hpo.executor._isolation import check_process_slots
from waterwave_hpo.executor._optimize import Callback
from waterwave_hpo.executor._optimize import ObjectiveFunc
from waterwave_hpo.executor._optimize import OptimizeRun
from waterwave_hpo.executor._storage_errors import check_storage_writable
from waterwave_hpo.host import DeviceHost
from waterwave_hpo.host import DeviceMemory
from waterwave_hpo.host import DeviceSpec
from waterwave_hpo.host import MemoryPlanMode
from waterwave_hpo.host import MemoryPoolMode
from waterwave_hpo.host import OnOOM
from waterwave_hpo.host import RunSettings
from waterwave_hpo.host import check_fuse_matches
from waterwave_hpo.host import check_pool_device
from waterwave_hpo.host import is_batched
from waterwave_hpo.host import plan_settings
from waterwave_hpo.host import resolve_devices
from waterwave_hpo.scheduler import PipelineScheduler
from waterwave_hpo.scheduler import Policy
from waterwave_hpo.scheduler import PolicyName
from waterwave_hpo.scheduler import make_policy
from waterwave_hpo.sim import PackingPrediction


class WaterwaveExecutor:
    """Run an Optuna study's trials concurrently, several per device, in one process.

    Each device gets a host with ``trials_per_device`` slots; each slot is a thread with its own
    CUDA stream (current in that thread), so co-hosted trials overlap on the GPU as in Waterwave
    (IEEE TC 2023, Sec. 3). On a CPU-only machine the same code runs trials concurrently on the
    CPU. Trials are driven with ``study.ask()``/``study.tell()``, so any ``optuna.Study`` works:
    its sampler, pruner and storage are used as they are.

    >>> import optuna
    >>> import waterwave_hpo as ww
    >>> optuna.logging.set_verbosity(optuna.logging.WARNING)
    >>> study = optuna.create_study()
    >>> executor = ww.WaterwaveExecutor("cpu", trials_per_device=2)
    >>> executor.optimize(study, lambda trial: trial.suggest_float("x", -1, 1) ** 2, n_trials=4)
    >>> sorted({t.state.name for t in study.trials}), len(study.trials)
    (['COMPLETE'], 4)

    Experimental on CUDA: the CUDA path (a stream per trial, the pool as PyTorch's allocator)
    is tested against fakes on the CPU and ran on one GPU (an H200, 2026-11-27), where every
    trial completed but its speed-up is not yet shown; the first CUDA device in a process emits
    :class:`waterwave_hpo.ExperimentalWarning`, which says what has run on a GPU.

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
            and keep PyTorch's), one account per trial; if the torch shim (typed OOM,
            ``record_stream``) cannot be built, a warning with the compiler's message, once;
            ``"on"``: the same, but raise instead of falling back or running without the
            shim (a device that is not CUDA, which the pool cannot serve, is refused here);
            ``"off"``: PyTorch's allocator.
        max_trials_per_device: The cap for ``trials_per_device="auto"`` (>= 1).
        record_trial_attrs: Record where and how each trial ran as system attributes of the
            trial (``waterwave:device``, ``waterwave:slot``, ``waterwave:peak_bytes``,
            ``waterwave:fail_reason``; read them with
            ``waterwave_hpo.executor.trial_attr``), which ``waterwave_hpo.report``'s trials
            table and timeline show. Off by default, so a study's trials look as
            ``Study.optimize`` leaves them (``trials_dataframe()`` has Optuna's columns). The
            user's ``user_attrs`` are never touched. A re-run after an out-of-memory error
            always records ``waterwave:retry_of`` and ``waterwave:attempt``. A trial of a
            fused batch also records ``waterwave:batch`` (the numbers of its batch's trials).
        memory_plan: ``"off"`` (default) or ``"home"``: a model the objective registers with
            :func:`waterwave_hpo.fit_trial_memory` runs with a HOME memory plan
            (keep/swap/recompute per unit, He et al., IEEE TC 2022) for the memory left beside
            its neighbours when its plain step does not fit there, instead of waiting; an
            attempt that still runs out of memory (or is evicted) is re-run at once with a plan
            for at most half its footprint (:data:`waterwave_hpo.sim.PLAN_SHRINK`), even
            alone, up to ``max_oom_retries`` times; a model whose smallest plan exceeds the
            budget fails with the floor named. The plan is kept in the trial's system
            attribute ``waterwave:memory_plan`` (:func:`waterwave_hpo.executor.trial_memory_plan`)
            and in ``trials.csv``; ``trials_per_device="auto"`` admits a trial at its planned
            footprint.
        memory_planner: The planner for ``memory_plan="home"``: ``"pso"`` (HOME, default),
            ``"capuchin"`` or ``"exhaustive"`` (at most 10 units).
        fuse: ``None`` (default): each slot runs one trial at a time. ``K >= 1``: the objective
            is batched (:func:`waterwave_hpo.batched`) and each slot asks the study for up to K
            trials at once and runs them in one call, e.g. as one fused model (horizontal
            fusion, HFTA, arXiv:2102.02344); each trial still ends on its own (value, PRUNED
            or FAIL, callbacks, logs). ``n_trials``, ``timeout`` and ``study.stop()`` are
            checked before each trial is asked, so a batch may hold fewer than K trials. With
            ``trials_per_device=N``, up to N batches run side by side on each device. A fused
            batch that runs out of device memory fails its trials and, with
            ``on_oom="retry"``, re-queues each one's parameters to run alone (a batch of one).
            With ``memory_plan="home"`` the batch is one attempt: the model it registers with
            :func:`waterwave_hpo.fit_trial_memory` (the fused model) is planned as one, and
            the plan is recorded on each of its trials.
        isolation: ``"threads"`` (default): each slot is a thread of this process, with its
            own CUDA stream, and all trials of a device share one stream-aware pool (memory
            flows between them). ``"process"``: each slot runs its trials in a worker process
            of its own, on the slot's device and its own stream, reaching the study through
            this process (which tells every outcome, runs the callbacks and writes the
            heartbeats). The workers are forked by the executor's own zygote, itself forked
            from one interpreter per process that imported torch and this package and never
            the user's script (so no ``if __name__ == "__main__":`` guard is needed), on the
            first :meth:`optimize`, and kept warm for the later ones, of any study, until
            :meth:`close` (or the ``with`` block's end, the executor's garbage collection, the
            interpreter's exit); where fork cannot serve they are fresh interpreters, and the
            executor says so once. A worker that dies (segmentation fault,
            ``abort()``, ``os._exit``, SIGKILL, the OOM killer) fails its trial alone, with
            the signal or exit code in the trial's ``waterwave:fail_reason`` system
            attribute, and a new worker takes the slot at once, with what that worker
            started; a seeded trial gives the same result as alone, whatever its neighbours
            do. On CUDA each worker holds a lease of the device's memory
            (``memory_budget_bytes`` or the device's total less a reserve, split over
            ``trials_per_device``) and bounds each of its trials by it (the bytes the trial
            allocates); each worker's pipeline scheduler and memory plans get
            ``memory_budget_bytes // trials_per_device``. The objective, the sampler, the
            pruner and ``catch`` are pickled (cloudpickle: closures, lambdas and functions of
            the script run go by value). ``trials_per_device="auto"`` is not supported with
            it. A worker is counted at 550 MiB of host memory (a fresh interpreter's; a
            forked worker shares most of it): ``trials_per_device`` times the devices' workers
            must fit the host memory available when the executor is made, and
            ``memory_budget_bytes`` must leave each slot at least one byte; both are refused up
            front with the figures.

    Raises:
        ValueError: For an argument out of range or a device that does not exist; the message
            names the argument, the value and the fix.
        TypeError: For an argument of the wrong type.

    Example::

        import waterwave_hpo as ww

        study = ww.create_study(direction="maximize")
        study.optimize(objective, n_trials=64, executor=ww.WaterwaveExecutor(trials_per_device=4))
    """

    isolation: Isolation = Isolation.THREADS
    """How the trials of a device are kept apart (``isolation=``)."""
    _workers: Any = None
    """With ``isolation="process"``: the warm worker processes (``WorkerPools``), once started."""
    _workers_lock = threading.Lock()
    """Guards the start of ``_workers`` (two threads' first ``optimize`` calls start one set)."""

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
        memory_plan: MemoryPlanMode | str = MemoryPlanMode.OFF,
        memory_planner: str = "pso",
        fuse: int | None = None,
        isolation: Isolation | str = Isolation.THREADS,
    ) -> None:
        self.devices: list[torch.device] = resolve_devices(devices)
        self.isolation = check_isolation(isolation, trials_per_device)
        self._init_trial_settings(
            trials_per_device,
            on_oom=on_oom,
            max_oom_retries=max_oom_retries,
            memory_budget_bytes=memory_budget_bytes,
            policy=policy,
            memory_pool=memory_pool,
            max_trials_per_device=max_trials_per_device,
            record_trial_attrs=record_trial_attrs,
            memory_plan=memory_plan,
            memory_planner=memory_planner,
            fuse=fuse,
        )
        for device in self.devices:
            check_pool_device(self.memory_pool, device)
        if self.isolation is Isolation.PROCESS:
            check_process_slots(self.trials_per_device, len(self.devices), self.memory_budget_bytes)

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
        memory_plan: MemoryPlanMode | str = MemoryPlanMode.OFF,
        memory_planner: str = "pso",
        fuse: int | None = None,
    ) -> None:
        """Check and keep the settings every host applies.

        Check and keep the settings every host applies (all but the devices, which a
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
        self.memory_plan = plan_settings(memory_plan, memory_planner)
        self.fuse = _checks.check_optional_int(
            "fuse",
            fuse,
            minimum=1,
            fix="pass the number of trials a batched objective runs at once, e.g. fuse=8, "
            "or None to run one trial per call",
        )
        self.max_trials_per_device = _check_slots(
            "max_trials_per_device",
            _check_positive_int("max_trials_per_device", max_trials_per_device, 1),
        )
        self.auto_trials = trials_per_device == "auto"
        if isinstance(trials_per_device, str) and not self.auto_trials:
            raise _checks.type_error(
                "trials_per_device", trials_per_device, "an int >= 1 or 'auto'", "pass e.g. 4"
            )
        self.trials_per_device = (
            self.max_trials_per_device
            if self.auto_trials
            else _check_slots(
                "trials_per_device",
                _check_positive_int("trials_per_device", trials_per_device, 1),
            )
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

    def _hosts_up(self) -> bool:
        """Whether the next ``optimize`` call's hosts need no start-up.

        True for threads, and for worker processes kept from an earlier call on every device;
        a subclass whose hosts start per call says ``False``. The run's first asks then check
        its timeout as of the call, as ``Study.optimize``'s threads do; after a start-up, as of
        its end.
        """
        if self.isolation is not Isolation.PROCESS:
            return True
        with self._workers_lock:
            pools = {} if self._workers is None else self._workers.pools
            return all(str(device) in pools for device in self.devices)

    def _make_hosts(self, settings: RunSettings) -> Sequence[HostHandle[Any]]:
        """The device hosts of one ``optimize`` call.

        The device hosts of one ``optimize`` call (a subclass may return other :class:`HostHandle`
        implementations, e.g. :class:`waterwave_hpo.cluster.RayExecutor`'s remote hosts). The loop
        reads the returned list on every turn, so a subclass may append hosts to it later from
        another thread (a host that joins mid-study).

        Raises:
            TypeError: With ``isolation="process"``, if the objective, the sampler, the pruner
                or ``catch`` cannot be pickled (before any trial is asked).
        """
        if self.isolation is Isolation.PROCESS:
            from waterwave_hpo.workers import WorkerPools
            from waterwave_hpo.workers import process_hosts

            with self._workers_lock:
                if self._workers is None:
                    self._workers = WorkerPools()
                workers = self._workers
            return process_hosts(
                workers,
                self.devices,
                self.trials_per_device,
                settings,
                memory_pool=self.memory_pool,
                memory_budget_bytes=self.memory_budget_bytes,
                policy=self.policy,
                memory_plan=self.memory_plan,
                # The run loop's rule for its own threads (OptimizeRun._concurrent).
                reseed_sampler_rng=(self.fuse or 1) > 1
                or len(self.devices) * self.trials_per_device > 1,
            )
        return [
            DeviceHost.build(
                device,
                self.trials_per_device,
                settings,
                memory_pool=self.memory_pool,
                memory_budget_bytes=self.memory_budget_bytes,
                policy=self.policy,
                admit_by_memory=self.auto_trials,
            )
            for device in self.devices
        ]

    def close(self) -> None:
        """End the executor's worker processes (``isolation="process"``). Idempotent.

        The workers are started by the first :meth:`optimize` and kept warm for the next ones;
        this ends them (each is asked to exit, and killed after a few seconds). A later
        :meth:`optimize` starts new ones. Also done by the ``with`` statement's end, when the
        executor is garbage-collected, and at the interpreter's exit. Nothing to do with
        threads.
        """
        with self._workers_lock:
            workers, self._workers = self._workers, None
        if workers is not None:
            workers.close()

    def __enter__(self) -> WaterwaveExecutor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def schedulers(self) -> dict[str, PipelineScheduler]:
        """The pipeline scheduler of each device, for their ``stats()``.

        The pipeline scheduler of each device (``"cpu"``, ``"cuda:0"``, ...) of the most
        recent :meth:`optimize` call, for their ``stats()``; devices without one are left out.
        """
        return dict(self._schedulers)

    @property
    def packing_predictions(self) -> dict[str, PackingPrediction]:
        """What ``trials_per_device="auto"`` follows on each device.

        What ``trials_per_device="auto"`` follows on each device (``"cpu"``, ``"cuda:0"``,
        ...) in the most recent :meth:`optimize` call: the simulator's best number of trials at
        once for the largest NodeGroup profile seen there
        (:func:`waterwave_hpo.sim.predict_auto_packing`). Devices with no prediction yet (no
        gates declared a profile, no scheduler, or a fixed ``trials_per_device``) are left out.
        """
        predictions = {name: memory.packing for name, memory in self._memories.items()}
        return {name: p for name, p in predictions.items() if p is not None}

    def __repr__(self) -> str:
        devices = ", ".join(str(device) for device in self.devices)
        return (
            f"WaterwaveExecutor(devices=[{devices}], trials_per_device="
            f"{'auto' if self.auto_trials else self.trials_per_device}, "
            f"on_oom={self.on_oom.value!r}, max_oom_retries={self.max_oom_retries}, "
            f"memory_budget_bytes={self.memory_budget_bytes}, "
            f"memory_pool={self.memory_pool.value!r}, "
            f"memory_plan={self.memory_plan.mode.value!r}, fuse={self.fuse}, "
            f"isolation={self.isolation.value!r})"
        )

    def _check_run(
        self,
        study: optuna.Study,
        func: ObjectiveFunc,
        n_trials: int | None,
        timeout: float | None,
        catch: Iterable[type[Exception]] | type[Exception],
        callbacks: Iterable[Callback] | None,
    ) -> tuple[int | None, tuple[type[Exception], ...], list[Callback]]:
        """Check :meth:`optimize`'s arguments (every executor's, before it starts anything).

        Returns:
            ``n_trials``, ``catch`` as a tuple and ``callbacks`` as a list.

        Raises:
            TypeError, ValueError, RuntimeError: As :meth:`optimize`.
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
        check_fuse_matches(
            func,
            self.fuse,
            name="func",
            kind="objective",
            setting="WaterwaveExecutor(fuse=K)",
            noun="trials",
        )
        _checks.check_takes_one_argument(
            "func",
            func,
            "a list of trials" if is_batched(func) else "a trial",
            "define the objective as def objective(trial): ... and return its value",
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
        check_storage_writable(study)
        return n_trials, catch_tuple, callback_list

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
                gives the trial's device and stream. With ``fuse=K``, a batched objective
                (:func:`waterwave_hpo.batched`) taking a list of up to K trials and returning
                one entry per trial.
            n_trials: How many new trials to run (>= 0); ``None`` for no limit. Re-runs of
                parameters after an out-of-memory error do not count.
            timeout: Stop starting trials this many seconds (> 0) after the call, as
                ``Study.optimize`` does (the start of worker processes or host actors counts);
                running trials finish. ``None`` for no limit.
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
            TypeError: If ``study``, ``func``, ``catch`` or ``callbacks`` has the wrong type
                (``func`` not batched while ``fuse`` is set).
            ValueError: If ``n_trials`` or ``timeout`` is out of range, the study's storage
                is an in-memory SQLite database (``sqlite:///:memory:``), or ``func`` is
                batched and ``fuse`` is not set.
            RuntimeError: If called inside another ``optimize`` of the same study.
            Exception: The first exception an objective raised that is not in ``catch``, after
                the other running trials have finished and been told.
            KeyboardInterrupt: On Ctrl+C, after every running trial has been told FAIL.
        """
        called_at = time.monotonic()  # the timeout counts from here, as Study.optimize's
        n_trials, catch_tuple, callback_list = self._check_run(
            study, func, n_trials, timeout, catch, callbacks
        )

        run = OptimizeRun(
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
                memory_plan=self.memory_plan,
            ),
            n_trials=n_trials,
            timeout_s=None if timeout is None else float(timeout),
            callbacks=callback_list,
            show_progress_bar=bool(show_progress_bar),
            time_start=called_at,
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


MAX_TRIALS_PER_DEVICE = 1024
"""The most slots a device may have: each is an OS thread (with a CUDA stream on a GPU),
created up front; far more trials than that cannot make progress on one device."""


def _check_slots(name: str, value: int) -> int:
    return _checks.check_at_most(
        name,
        value,
        MAX_TRIALS_PER_DEVICE,
        "each trial slot is a thread, with a CUDA stream on a GPU, made before the first trial",
        "pass the number of trials one device should run at once, e.g. 4, or "
        "trials_per_device='auto' with max_trials_per_device",
    )


def _check_positive_int(name: str, value: object, minimum: int) -> int:
    return _checks.check_int(name, value, minimum=minimum)


def check_isolation(value: object, trials_per_device: object) -> Isolation:
    """``isolation=`` of an executor (this one or the Ray executor), with its one constraint.

    Raises:
        ValueError: ``value`` is not an :class:`Isolation`, or it is ``"process"`` with
            ``trials_per_device="auto"``.
    """
    isolation = _checks.check_choice(
        "isolation",
        value,
        Isolation,
        "pass 'threads' (default: the trials of a device share one process and its memory "
        "pool) or 'process' (each trial slot runs its trials in a process of its own)",
    )
    if isolation is Isolation.PROCESS and trials_per_device == "auto":
        raise _checks.value_error(
            "trials_per_device",
            trials_per_device,
            "is not supported with isolation='process' (each slot is a process started up "
            "front, and processes do not share the memory measurements 'auto' admits trials by)",
            "pass an int, the number of trial processes per device, e.g. trials_per_device=4",
        )
    return isolation


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
