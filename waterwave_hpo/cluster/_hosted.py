"""Ray Tune trials run inside one process per GPU: the host side of ``tune_hosts()``.

The second of the two ways to run Ray Tune trials that the README compares (the first is
``shared_gpu()``'s per-GPU lease broker, :mod:`waterwave_hpo.cluster._tune`): each Tune trial
stays a Tune trial (its own small process, its results and checkpoints where Tune puts them),
but its training function runs in a thread of the GPU's *host* process, next to the other
trials on that GPU: each on its own CUDA stream, all drawing from one stream-aware pool, their
NodeGroups ordered by one pipeline scheduler (in-process co-hosting, the full Waterwave, IEEE
TC 2023, Secs. 3-4). :class:`TrialHost` is that host without Ray, so that it is tested
directly; :mod:`waterwave_hpo.cluster._tune_hosts` puts it in a Ray actor and streams each
trial's ``tune.report`` results back to its Tune trial.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
import contextlib
import ctypes
from dataclasses import dataclass
from dataclasses import field
import io
import itertools
from pathlib import Path
import shutil
import tarfile
import tempfile
import threading
import time
import traceback
from types import SimpleNamespace
from typing import Any

import torch

from waterwave_hpo.cluster import _ray_compat
from waterwave_hpo.executor import MemoryPoolMode
from waterwave_hpo.executor import TrialContext
from waterwave_hpo.executor import is_out_of_memory
from waterwave_hpo.executor._internal import MemoryPlanMode
from waterwave_hpo.executor._internal import NoOptunaTrial
from waterwave_hpo.executor._internal import TrialPlanning
from waterwave_hpo.executor._internal import acquire_stream
from waterwave_hpo.executor._internal import make_device_memory
from waterwave_hpo.executor._internal import plan_settings
from waterwave_hpo.executor._internal import release_stream
from waterwave_hpo.executor._internal import run_attempt

_WAIT_S = 0.05
_ERROR_MAX_CHARS = 8000


class HostedTrialStopped(BaseException):
    """Raised inside a hosted trial's thread when its Tune trial was stopped.

    Raised inside a hosted trial's thread when its Tune trial was stopped (a Tune scheduler
    such as ASHA stopped it, or its Tune process stopped polling for ``heartbeat_ttl_s``).

    A ``BaseException``, like ``KeyboardInterrupt``, so that a training loop's ``except
    Exception`` does not swallow it.
    """


@dataclass(frozen=True)
class HostedEvent:
    """One thing a hosted trial did, for its Tune trial to replay.

    Attributes:
        kind: ``"result"`` (a ``tune.report``), ``"done"`` (the function returned) or
            ``"error"`` (it raised).
        metrics: The reported metrics (``"result"``).
        checkpoint: The reported checkpoint directory as a gzipped tar (``"result"``), or
            ``None``.
        error: The traceback, as text (``"error"``).
        out_of_memory: Whether the error was the device running out of memory.
    """

    kind: str
    metrics: dict[str, Any] | None = None
    checkpoint: bytes | None = None
    error: str | None = None
    out_of_memory: bool = False


@dataclass(frozen=True)
class HostStats:
    """One host's trials at one moment.

    Attributes:
        device: The host's device.
        running: Trials whose function runs now.
        waiting: Trials started by Tune that wait for room on the device.
        peak_running: The most trials that ran at once so far.
        finished: Trials whose function returned, raised or was stopped.
    """

    device: str
    running: int
    waiting: int
    peak_running: int
    finished: int


@dataclass
class _Hosted:
    key: str
    number: int
    fn: Callable[[dict[str, Any]], Any]
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
        heartbeat_ttl_s: A trial whose Tune process has not polled for this long is stopped.
        memory_plan, memory_planner: As for ``WaterwaveExecutor``: each hosted trial's
            attempt gets its own memory planning, which ``fit_trial_memory`` reads.
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
    ) -> None:
        self.device = device
        self.trials_per_device = trials_per_device
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
        self._cond = threading.Condition()
        self._trials: dict[str, _Hosted] = {}
        self._numbers = itertools.count()
        self._queue: deque[_Hosted] = deque()
        self._running = 0
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
        fn: Callable[[dict[str, Any]], Any],
        config: dict[str, Any],
        checkpoint: bytes | None = None,
    ) -> None:
        """Queue trial ``key``: run ``fn(config)`` once the device has room.

        Args:
            key: The Tune trial's id (unique on this host).
            fn: A function trainable; it may call ``ray.tune.report`` and
                ``ray.tune.get_checkpoint`` as in any Tune trial.
            config: Its config.
            checkpoint: The checkpoint to resume from (a gzipped tar of its directory), or
                ``None``.

        Raises:
            RuntimeError: If the host is shut down.
            ValueError: If ``key`` is already running or waiting here.
        """
        with self._cond:
            if self._closed:
                raise RuntimeError(f"The trial host on {self.device} is shut down.")
            old = self._trials.get(key)
            if old is not None and not old.ended:
                raise ValueError(f"Trial {key!r} is already running or waiting on {self.device}.")
            hosted = _Hosted(key, next(self._numbers), fn, config, checkpoint, time.monotonic())
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
        with self._cond:
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

    def stop(self, key: str) -> None:
        """Stop trial ``key``.

        Stop trial ``key``: a waiting trial never starts; a running one gets
        :class:`HostedTrialStopped` at its next ``tune.report`` (or at once, in Python code).
        Unknown keys are ignored.
        """
        with self._cond:
            hosted = self._trials.pop(key, None)
            if hosted is None:
                return
            self._stop_locked(hosted)

    def stats(self) -> HostStats:
        """The host's trials now."""
        with self._cond:
            return HostStats(
                device=str(self.device),
                running=self._running,
                waiting=len(self._queue),
                peak_running=self._peak_running,
                finished=self._finished,
            )

    def load(self) -> int:
        """Trials running or waiting here: the Tune side sends a new trial to the least loaded."""
        with self._cond:
            return self._running + len(self._queue)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop every trial and wait up to ``timeout_s`` for their threads; idempotent."""
        with self._cond:
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
        elif hosted.in_fn and hosted.thread is not None and hosted.thread.ident is not None:
            # Arrives at the thread's next bytecode; a long native call finishes first.
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(hosted.thread.ident), ctypes.py_object(HostedTrialStopped)
            )
        self._cond.notify_all()

    def _has_room_locked(self) -> bool:
        if self._running >= self.trials_per_device:
            return False
        if self.auto and self._running > 0:
            return self.memory.has_room()
        return True

    def _admit_loop(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                for hosted in list(self._trials.values()):
                    if now - hosted.last_seen > self.heartbeat_ttl_s:
                        del self._trials[hosted.key]  # its Tune process is gone
                        if not hosted.ended:
                            self._stop_locked(hosted)
                while self._queue and self._has_room_locked():
                    hosted = self._queue.popleft()
                    hosted.running = True
                    self._running += 1
                    self._peak_running = max(self._peak_running, self._running)
                    self.memory.trial_admitted(SimpleNamespace(number=hosted.number))
                    hosted.thread = threading.Thread(
                        target=self._run,
                        args=(hosted,),
                        name=f"waterwave-tune-{self.device}-{hosted.key}",
                        daemon=True,
                    )
                    hosted.thread.start()
                self._cond.wait(_WAIT_S)

    def _run(self, hosted: _Hosted) -> None:
        # The executor's one run path (executor/_run.py): context, pool account, stream, and
        # the scheduler's share ended however the trial ends; only the reporting is Tune's.
        device = self.device
        stream = None
        event = HostedEvent("done")
        checkpoint_dir: str | None = None
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
                stream = acquire_stream(device)
            if hosted.checkpoint is not None:
                checkpoint_dir = unpack_directory(hosted.checkpoint)
                hosted.loaded_checkpoint = _ray_compat.checkpoint_from_directory(checkpoint_dir)
            planning = None
            if self.plan_settings.mode is not MemoryPlanMode.OFF:
                planning = TrialPlanning(self.plan_settings, device_plans=self.memory.plans)
            context = TrialContext(
                trial=NoOptunaTrial("tune_hosts()"),
                trial_number=hosted.number,
                device=device,
                stream=stream,
                slot=0,
                scheduler=self.memory.scheduler,
                planning=planning,
            )
            self._local.hosted = hosted
            try:
                attempt = run_attempt(
                    lambda: hosted.fn(hosted.config),
                    context=context,
                    memory=self.memory,
                    seat=_HostedSeat(self, hosted),
                )
            finally:
                self._local.hosted = None
            error = attempt.error
            if error is not None and not isinstance(error, HostedTrialStopped):
                event = _error_event(error, attempt.out_of_memory)
        except HostedTrialStopped:
            pass  # a stop that landed outside the objective: the trial is done
        except BaseException as error:  # the host's own setup failed: the trial fails alone
            event = _error_event(error, isinstance(error, Exception) and is_out_of_memory(error))
        finally:
            with contextlib.suppress(Exception):
                self.memory.trial_ended(hosted.number)  # idempotent; run_attempt ended it
            if stream is not None:
                with contextlib.suppress(Exception):
                    release_stream(stream)
            if checkpoint_dir is not None:
                shutil.rmtree(checkpoint_dir, ignore_errors=True)
        with self._cond:
            hosted.events.append(event)
            hosted.running = False
            hosted.ended = True
            self._running -= 1
            self._finished += 1
            self._cond.notify_all()

    # ------------------------------------------------------------------ tune.report, inside
    def _session_trial(self) -> _SessionTrial | None:
        hosted: _Hosted | None = getattr(self._local, "hosted", None)
        if hosted is None:
            return None
        return _SessionTrial(self, hosted)


class _HostedSeat:
    """A hosted trial's thread as :func:`run_attempt` sees it: stoppable only inside ``fn``."""

    def __init__(self, host: TrialHost, hosted: _Hosted) -> None:
        self.host = host
        self.hosted = hosted

    def enter(self) -> None:
        # A stop is raised in this thread only while in_fn, set and cleared under the lock, so
        # it arrives inside run_attempt's try (at the latest while taking the lock in leave).
        with self.host._cond:
            if self.hosted.stopped:
                raise HostedTrialStopped
            self.hosted.in_fn = True

    def leave(self) -> int:
        try:
            with self.host._cond:
                self.hosted.in_fn = False
                return max(0, self.host._running - 1)
        except HostedTrialStopped:  # sent just before in_fn was cleared: the trial is done
            with self.host._cond:
                self.hosted.in_fn = False
                return max(0, self.host._running - 1)


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
            raise HostedTrialStopped
        packed = None if checkpoint is None else _ray_compat.pack_checkpoint(checkpoint)
        with self.host._cond:
            self.hosted.events.append(HostedEvent("result", dict(metrics), packed))
            self.host._cond.notify_all()

    @property
    def loaded_checkpoint(self) -> Any:
        return self.hosted.loaded_checkpoint


def pack_directory(path: str | Path) -> bytes:
    """A directory's files as a gzipped tar (for a checkpoint crossing processes or nodes)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(str(path), arcname=".")
    return buffer.getvalue()


def unpack_directory(data: bytes) -> str:
    """Unpack a checkpoint directory into a new temporary directory.

    Unpack :func:`pack_directory`'s bytes into a new temporary directory; returns its path
    (the caller removes it).
    """
    directory = tempfile.mkdtemp(prefix="waterwave-checkpoint-")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4
            tar.extractall(directory, filter="data")
        else:  # pragma: no cover - older patch releases; the tar is our own
            tar.extractall(directory)
    return directory
