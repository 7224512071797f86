"""Ray Tune trials run inside one process per GPU: the host side of ``tune_hosts()``.

The second of the two ways to run Ray Tune trials that the user guide compares (the first is
``shared_gpu()``'s per-GPU lease broker, :mod:`waterwave_hpo.cluster._tune`): each Tune trial
stays a Tune trial (its own small process, its results and checkpoints where Tune puts them),
but its training function runs in a thread of the GPU's *host* process, next to the other
trials on that GPU: each on its own CUDA stream, all drawing from one stream-aware pool, their
NodeGroups ordered by one pipeline scheduler (in-process co-hosting, the full Waterwave, IEEE
TC 2023, Secs. 3-4). :class:`TrialHost` is that host without Ray, so that it is tested
directly; :mod:`waterwave_hpo.cluster._tune_hosts` puts it in a Ray actor and streams each
trial's ``tune.report`` results back to its Tune trial.

With ``fuse=K`` and a batched trainable (:func:`waterwave_hpo.batched`), the host gathers up to
K Tune trials of one fusion group that arrive together and runs them as one call of the
trainable, one fused batch (HFTA, arXiv:2102.02344), through the executor's one run path
(``run_attempt``); each Tune trial keeps its own reports, checkpoints and end, and a trial Tune
stops drops out of its batch while its batch-mates go on (:class:`TuneBatchTrial`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Sequence
import contextlib
import ctypes
from dataclasses import dataclass
from dataclasses import field
import itertools
import shutil
import threading
import time
import traceback
from types import SimpleNamespace
from typing import Any

import torch

from waterwave_hpo.cluster import _ray_compat
from waterwave_hpo.cluster._hosted_events import HostedEvent
from waterwave_hpo.cluster._hosted_events import HostStats
from waterwave_hpo.cluster._hosted_events import unpack_directory
from waterwave_hpo.host import MemoryPlanMode
from waterwave_hpo.host import MemoryPoolMode
from waterwave_hpo.host import TrialPlanning
from waterwave_hpo.host import acquire_stream
from waterwave_hpo.host import is_batched
from waterwave_hpo.host import is_out_of_memory
from waterwave_hpo.host import make_device_memory
from waterwave_hpo.host import plan_settings
from waterwave_hpo.host import release_stream
from waterwave_hpo.host import run_attempt
from waterwave_hpo.trial import NoOptunaTrial
from waterwave_hpo.trial import TrialContext

_WAIT_S = 0.05
_ERROR_MAX_CHARS = 8000


class HostedTrialStopped(BaseException):
    """Raised inside a hosted trial's thread when its Tune trial was stopped.

    Raised inside a hosted trial's thread when its Tune trial was stopped (a Tune scheduler
    such as ASHA stopped it, or its Tune process stopped polling for ``heartbeat_ttl_s``).

    A ``BaseException``, like ``KeyboardInterrupt``, so that a training loop's ``except
    Exception`` does not swallow it.
    """


@dataclass
class _Hosted:
    key: str
    number: int
    fn: Callable[[Any], Any]  # a config, or a batched trainable's list of trials
    config: dict[str, Any]
    checkpoint: bytes | None
    last_seen: float
    events: deque[HostedEvent] = field(default_factory=deque)
    stopped: bool = False
    running: bool = False
    in_fn: bool = False  # inside fn(config): only then may HostedTrialStopped be raised in it
    ended: bool = False
    thread: threading.Thread | None = None
    loaded_checkpoint: Any = None
    arrived: float = 0.0
    group: str | None = None  # a batched trainable's fusion group: who may share its batch
    batch: list[_Hosted] | None = None  # a batched trainable's batch, itself included

    @property
    def batched(self) -> bool:
        return is_batched(self.fn)


class TrialHost:
    """Runs Tune trials' function trainables as co-hosted threads on one device.

    Args:
        device: The device (``cuda:N`` or ``cpu``).
        trials_per_device: Trials run at once (>= 1); ``auto`` then caps it.
        auto: Admit another trial only while the device's measured memory (and the NodeGroup
            profiles, with the simulator's packing) leaves room, as
            ``WaterwaveExecutor(trials_per_device="auto")``.
        policy: The pipeline scheduler's policy (``"waterwave"`` or ``"fifo"``).
        memory_budget_bytes: The scheduler's budget; ``None``: the pool's capacity on CUDA, no
            scheduler on the CPU.
        memory_pool: ``"auto"``, ``"on"`` or ``"off"``, as the executor's.
        heartbeat_ttl_s: A trial whose Tune process has neither polled nor touched it (see
            :meth:`touch`) for this long is stopped: that process is gone.
        memory_plan, memory_planner: As for ``WaterwaveExecutor``: each hosted trial's
            attempt gets its own memory planning, which ``fit_trial_memory`` reads.
        fuse: ``None``: one trial per call. ``K >= 1``: a batched trainable
            (:func:`waterwave_hpo.batched`) is called with up to K trials of one fusion group
            at once; such a batch takes one of the ``trials_per_device`` places.
        fuse_wait_s: How long the first trial of a group waits for batch-mates (seconds >= 0)
            before it runs with fewer than ``fuse``.
    """

    def __init__(
        self,
        device: torch.device,
        trials_per_device: int,
        *,
        auto: bool = False,
        policy: str = "waterwave",
        memory_budget_bytes: int | None = None,
        memory_pool: str = "auto",
        heartbeat_ttl_s: float = 30.0,
        memory_plan: str = "off",
        memory_planner: str = "pso",
        fuse: int | None = None,
        fuse_wait_s: float = 2.0,
    ) -> None:
        self.device = device
        self.trials_per_device = trials_per_device
        self.fuse = fuse
        self.fuse_wait_s = fuse_wait_s
        self.auto = auto
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.memory = make_device_memory(
            device,
            MemoryPoolMode(memory_pool),
            memory_budget_bytes,
            policy,
            max_trials=trials_per_device,
            plans=memory_plan != "off",
        )
        self.plan_settings = plan_settings(memory_plan, memory_planner)
        # Taken with `with self._lock` (a C-level lock: acquired and entered in one step), never
        # `with self._cond`: a stop is raised in a trial's thread asynchronously, and raised in
        # Condition.__enter__ (Python) right after the lock was taken, it would leave the lock
        # held for good. The condition, over the same lock, is only waited on and notified.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._trials: dict[str, _Hosted] = {}
        self._numbers = itertools.count()
        self._queue: deque[_Hosted] = deque()
        self._running = 0
        self._calls = 0  # calls of a trainable running now: a fused batch is one
        self._peak_running = 0
        self._finished = 0
        self._closed = False
        self._local = threading.local()
        _ray_compat.install_session(self._session_trial)
        self._admitter = threading.Thread(target=self._admit_loop, daemon=True)
        self._admitter.start()

    # ------------------------------------------------------------------ Tune-process side
    def start(
        self,
        key: str,
        fn: Callable[[Any], Any],
        config: dict[str, Any],
        checkpoint: bytes | None = None,
        group: str | None = None,
    ) -> None:
        """Queue trial ``key``: run ``fn(config)`` once the device has room.

        Args:
            key: The Tune trial's id (unique on this host).
            fn: A function trainable; it may call ``ray.tune.report`` and
                ``ray.tune.get_checkpoint`` as in any Tune trial. Or a batched trainable
                (:func:`waterwave_hpo.batched`), called as ``fn(trials)`` with a list of
                :class:`TuneBatchTrial` (up to ``fuse`` of them).
            config: Its config.
            checkpoint: The checkpoint to resume from (a gzipped tar of its directory), or
                ``None``.
            group: A batched trainable's fusion group: only trials of one group share a
                batch (``None``: the trial's own group).

        Raises:
            RuntimeError: If the host is shut down.
            ValueError: If ``key`` is already running or waiting here.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"The trial host on {self.device} is shut down.")
            old = self._trials.get(key)
            if old is not None and not old.ended:
                raise ValueError(f"Trial {key!r} is already running or waiting on {self.device}.")
            hosted = _Hosted(key, next(self._numbers), fn, config, checkpoint, time.monotonic())
            hosted.group = group if group is not None else f"trial:{key}"
            hosted.arrived = hosted.last_seen
            self._trials[key] = hosted
            self._queue.append(hosted)
            self._cond.notify_all()

    def poll(self, key: str, timeout_s: float = 1.0) -> list[HostedEvent]:
        """The trial's events since the last poll.

        The trial's events since the last poll, waiting up to ``timeout_s`` for one; keeps
        the trial alive (see ``heartbeat_ttl_s``). After a ``"done"`` or ``"error"`` event the
        trial is forgotten.

        Raises:
            KeyError: If ``key`` is not known here (never started, or already collected).
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            hosted = self._trials.get(key)
            if hosted is None:
                raise KeyError(f"No trial {key!r} on the host of {self.device}.")
            while not hosted.events and time.monotonic() < deadline:
                hosted.last_seen = time.monotonic()
                self._cond.wait(max(0.0, min(_WAIT_S * 4, deadline - time.monotonic())))
            hosted.last_seen = time.monotonic()
            events = list(hosted.events)
            hosted.events.clear()
            if any(e.kind != "result" for e in events):
                del self._trials[key]
            return events

    def touch(self, key: str) -> bool:
        """Keep trial ``key`` alive (see ``heartbeat_ttl_s``) without collecting its events.

        Sent by its Tune process while it waits in ``tune.report``: Tune's driver may take
        longer than ``heartbeat_ttl_s`` to take a result (a slow callback, a checkpoint upload),
        and the trial's process is alive meanwhile.

        Returns:
            Whether the trial is known here (``False``: collected, stopped or never started).
        """
        with self._lock:
            hosted = self._trials.get(key)
            if hosted is None:
                return False
            hosted.last_seen = time.monotonic()
            return True

    def stop(self, key: str) -> None:
        """Stop trial ``key``.

        Stop trial ``key``: a waiting trial never starts; a running one gets
        :class:`HostedTrialStopped` at its next ``tune.report`` (or at once, in Python code).
        A trial of a fused batch whose batch-mates still run drops out of the batch instead:
        its :attr:`TuneBatchTrial.stopped` turns true and its reports are dropped; the batch
        is stopped as above once all its trials are. Unknown keys are ignored.
        """
        with self._lock:
            hosted = self._trials.pop(key, None)
            if hosted is None:
                return
            self._stop_locked(hosted)

    def stats(self) -> HostStats:
        """The host's trials now."""
        with self._lock:
            return HostStats(
                device=str(self.device),
                running=self._running,
                waiting=len(self._queue),
                peak_running=self._peak_running,
                finished=self._finished,
            )

    def load(self) -> int:
        """Trials running or waiting here: the Tune side sends a new trial to the least loaded."""
        with self._lock:
            return self._running + len(self._queue)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop every trial and wait up to ``timeout_s`` for their threads; idempotent."""
        with self._lock:
            self._closed = True
            for hosted in list(self._trials.values()):
                self._stop_locked(hosted)
            threads = [h.thread for h in self._trials.values() if h.thread is not None]
            self._cond.notify_all()
        for thread in threads:
            thread.join(timeout=timeout_s)
        self._admitter.join(timeout=timeout_s)
        _ray_compat.uninstall_session(self._session_trial)

    # ------------------------------------------------------------------ host side
    def _stop_locked(self, hosted: _Hosted) -> None:
        hosted.stopped = True
        if hosted in self._queue:
            self._queue.remove(hosted)
            hosted.ended = True
            self._finished += 1
        elif hosted.batch is not None and not all(mate.stopped for mate in hosted.batch):
            pass  # its batch-mates go on: the trainable sees trial.stopped, its reports drop
        elif hosted.in_fn and hosted.thread is not None and hosted.thread.ident is not None:
            # Arrives at the thread's next bytecode; a long native call finishes first.
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(hosted.thread.ident), ctypes.py_object(HostedTrialStopped)
            )
        self._cond.notify_all()

    def _has_room_locked(self) -> bool:
        if self._calls >= self.trials_per_device:
            return False
        if self.auto and self._calls > 0:
            return self.memory.has_room()
        return True

    def _next_call_locked(self, now: float) -> list[_Hosted] | None:
        """The queue's head and its batch-mates, or ``None`` while the head waits for them."""
        head = self._queue[0]
        if not head.batched or self.fuse is None or self.fuse <= 1:
            return [head]
        mates = [h for h in self._queue if h.batched and h.group == head.group][: self.fuse]
        if len(mates) < self.fuse and now - head.arrived < self.fuse_wait_s:
            return None
        return mates

    def _admit_loop(self) -> None:
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                for hosted in list(self._trials.values()):
                    if now - hosted.last_seen > self.heartbeat_ttl_s:
                        del self._trials[hosted.key]  # its Tune process is gone
                        if not hosted.ended:
                            self._stop_locked(hosted)
                while self._queue and self._has_room_locked():
                    members = self._next_call_locked(now)
                    if members is None:
                        break  # the head waits a little for batch-mates
                    thread = threading.Thread(
                        target=self._run,
                        args=(members,),
                        name=f"waterwave-tune-{self.device}-{members[0].key}",
                        daemon=True,
                    )
                    for i, hosted in enumerate(members):
                        self._queue.remove(hosted)
                        hosted.running = True
                        hosted.thread = thread
                        if members[0].batched:
                            hosted.batch = members
                        self.memory.trial_admitted(  # a batch reserves under its first trial
                            SimpleNamespace(number=hosted.number), scheduled=i == 0
                        )
                    self._running += len(members)
                    self._calls += 1
                    self._peak_running = max(self._peak_running, self._running)
                    thread.start()
                self._cond.wait(_WAIT_S)

    def _run(self, members: list[_Hosted]) -> None:
        # The executor's one run path (host/_attempt.py): context, pool account, stream, and
        # the scheduler's share ended however the trial ends; only the reporting is Tune's. A
        # fused batch is one call of a batched trainable for all its trials.
        device = self.device
        lead = members[0]
        stream = None
        events = {hosted.key: HostedEvent("done") for hosted in members}
        checkpoint_dirs: list[str] = []
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
                stream = acquire_stream(device)
            for hosted in members:
                if hosted.checkpoint is not None:
                    checkpoint_dirs.append(unpack_directory(hosted.checkpoint))
                    hosted.loaded_checkpoint = _ray_compat.checkpoint_from_directory(
                        checkpoint_dirs[-1]
                    )
            planning = None
            if self.plan_settings.mode is not MemoryPlanMode.OFF:
                # A fused batch's model is planned as one (one registration, one footprint).
                planning = TrialPlanning(self.plan_settings, device_plans=self.memory.plans)
            context = TrialContext(
                trial=NoOptunaTrial("tune_hosts()"),
                trial_number=lead.number,
                device=device,
                stream=stream,
                slot=0,
                scheduler=self.memory.scheduler,
                planning=planning,
                batch=tuple(NoOptunaTrial("tune_hosts()") for _ in members) if lead.batched else (),
            )
            if lead.batched:
                trials = [TuneBatchTrial(self, hosted) for hosted in members]
                call: Callable[[], Any] = lambda: lead.fn(trials)  # noqa: E731
            else:
                call = lambda: lead.fn(lead.config)  # noqa: E731
            self._local.hosted = members
            try:
                attempt = run_attempt(
                    call,
                    context=context,
                    memory=self.memory,
                    seat=_HostedSeat(self, members),
                    numbers=[hosted.number for hosted in members],
                )
            finally:
                self._local.hosted = None
            error = attempt.error
            if error is not None and not isinstance(error, HostedTrialStopped):
                shared = _error_event(error, attempt.out_of_memory)
                events = {hosted.key: shared for hosted in members}
            elif error is None and lead.batched:
                events.update(_entry_events(members, attempt.result))
        except HostedTrialStopped:
            pass  # a stop that landed outside the objective: the trial is done
        except BaseException as error:  # the host's own setup failed: the trials fail alone
            shared = _error_event(error, isinstance(error, Exception) and is_out_of_memory(error))
            events = {hosted.key: shared for hosted in members}
        finally:
            for hosted in members:
                with contextlib.suppress(Exception):
                    self.memory.trial_ended(hosted.number)  # idempotent; run_attempt ended it
            if stream is not None:
                with contextlib.suppress(Exception):
                    release_stream(stream)
            for directory in checkpoint_dirs:
                shutil.rmtree(directory, ignore_errors=True)
        with self._lock:
            for hosted in members:
                hosted.events.append(events[hosted.key])
                hosted.running = False
                hosted.ended = True
            self._running -= len(members)
            self._calls -= 1
            self._finished += len(members)
            self._cond.notify_all()

    # ------------------------------------------------------------------ tune.report, inside
    def _session_trial(self) -> _SessionTrial | _BatchSession | None:
        members: list[_Hosted] | None = getattr(self._local, "hosted", None)
        if members is None:
            return None
        if members[0].batched:
            return _BatchSession(len(members))
        return _SessionTrial(self, members[0])


class _HostedSeat:
    """A hosted call's thread as :func:`run_attempt` sees it: stoppable only inside ``fn``."""

    def __init__(self, host: TrialHost, members: list[_Hosted]) -> None:
        self.host = host
        self.members = members

    def enter(self) -> None:
        # A stop is raised in this thread only while in_fn, set and cleared under the lock, so
        # it arrives inside run_attempt's try (at the latest while taking the lock in leave).
        with self.host._lock:
            if all(hosted.stopped for hosted in self.members):
                raise HostedTrialStopped
            for hosted in self.members:
                hosted.in_fn = True

    def leave(self) -> int:
        try:
            return self._leave()
        except HostedTrialStopped:  # sent just before in_fn was cleared: the trial is done
            return self._leave()

    def _leave(self) -> int:
        with self.host._lock:
            for hosted in self.members:
                hosted.in_fn = False
            return max(0, self.host._running - 1)


class TuneBatchTrial:
    """One Ray Tune trial of a fused batch, as a batched trainable sees it (``tune_hosts(fuse=K)``).

    A batched trainable (:func:`waterwave_hpo.batched`) run by ``tune_hosts(fuse=K)`` is called
    with a list of these, one per Tune trial of its batch (HFTA, arXiv:2102.02344). Each reports
    and checkpoints for its own Tune trial (``ray.tune.report`` cannot tell which trial of the
    batch it is for, so it is refused in a batched trainable). When Tune stops a trial (ASHA,
    a stopper, PBT's exploit) it drops out of the batch: :attr:`stopped` turns true and its
    further reports are dropped, while its batch-mates go on; the call is stopped once every
    trial of the batch is.

    Attributes:
        config: The Tune trial's config.
    """

    def __init__(self, host: TrialHost, hosted: _Hosted) -> None:
        self._host = host
        self._hosted = hosted
        self.config = hosted.config

    @property
    def stopped(self) -> bool:
        """Whether Tune stopped this trial: its reports are dropped; skip its work if you can."""
        return self._hosted.stopped

    def report(self, metrics: dict[str, Any], checkpoint: Any = None) -> None:
        """``ray.tune.report(metrics, checkpoint=...)`` for this trial; dropped once stopped.

        Args:
            metrics: The trial's metrics for this step.
            checkpoint: A ``ray.tune.Checkpoint`` of this trial's own state, or ``None``.
        """
        _SessionTrial(self._host, self._hosted).report(metrics, checkpoint)

    def get_checkpoint(self) -> Any:
        """``ray.tune.get_checkpoint()`` for this trial: where it resumes from, or ``None``."""
        return self._hosted.loaded_checkpoint

    def __repr__(self) -> str:
        return f"TuneBatchTrial({self._hosted.key!r}, stopped={self.stopped})"


@dataclass(frozen=True)
class _BatchSession:
    """``ray.tune.report``/``get_checkpoint`` in a batched trainable: ambiguous, so refused."""

    size: int

    def _refuse(self, call: str) -> RuntimeError:
        return RuntimeError(
            f"ray.tune.{call}() was called in a batched trainable running {self.size} Tune "
            f"trial(s) at once: it cannot tell which trial it is for. Call trials[i].{call}() "
            "on the TuneBatchTrial of the trial it is for."
        )

    def report(self, metrics: dict[str, Any], checkpoint: Any = None) -> None:
        raise self._refuse("report")

    @property
    def loaded_checkpoint(self) -> Any:
        raise self._refuse("get_checkpoint")


def _entry_events(members: list[_Hosted], result: object) -> dict[str, HostedEvent]:
    """The events of a batch whose batched trainable returned ``result``, by trial key.

    ``None``: every trial is done. A sequence of one entry per trial: an exception instance
    fails that trial alone; anything else is done. Anything else fails every trial.
    """
    if result is None:
        return {}
    if isinstance(result, (str, bytes)) or not isinstance(result, Sequence):
        reason = f"returned {type(result).__name__} {result!r:.80}"
    elif len(result) != len(members):
        reason = f"returned {len(result)} entries for a batch of {len(members)} trials"
    else:
        return {
            hosted.key: _error_event(entry, is_out_of_memory(entry))
            for hosted, entry in zip(members, result, strict=True)
            if isinstance(entry, BaseException)
        }
    text = (
        f"The batched trainable {reason}; return None, or one entry per trial in the order "
        "of the trials (an exception instance fails that trial alone)."
    )
    event = HostedEvent("error", error=text)
    return {hosted.key: event for hosted in members}


def _error_event(error: BaseException, out_of_memory: bool) -> HostedEvent:
    """The trial's own failure, as Tune is told it: its traceback's text; frames freed."""
    text = "".join(traceback.format_exception(error))
    if error.__traceback__ is not None:
        traceback.clear_frames(error.__traceback__)  # free its tensors now
    return HostedEvent("error", error=text[-_ERROR_MAX_CHARS:], out_of_memory=out_of_memory)


@dataclass(frozen=True)
class _SessionTrial:
    """What ``tune.report`` and ``tune.get_checkpoint`` reach in a hosted trial's thread."""

    host: TrialHost
    hosted: _Hosted

    def report(self, metrics: dict[str, Any], checkpoint: Any = None) -> None:
        if self.hosted.stopped:
            if self.hosted.batch is not None:
                return  # dropped out of its fused batch; the batch-mates go on
            raise HostedTrialStopped
        packed = None if checkpoint is None else _ray_compat.pack_checkpoint(checkpoint)
        with self.host._lock:
            self.hosted.events.append(HostedEvent("result", dict(metrics), packed))
            self.host._cond.notify_all()

    @property
    def loaded_checkpoint(self) -> Any:
        return self.hosted.loaded_checkpoint
