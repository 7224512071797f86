"""The one thread that owns an executor's worker processes' lives: :class:`WorkerManager`.

As ``concurrent.futures.process`` has its executor manager thread, an executor's worker
processes have one thread that creates, attaches, replaces and ends them, and serves their
pipes and the zygote's socket from one selector. It never waits on anything but the selector:
its sends are non-blocking (what a pipe cannot take now waits in the worker's outbox until the
pipe is writable), and what may take long (a storage call, telling the study how a trial
ended) runs in the slot's lane (:class:`Lane`), a thread of its own per slot, in order.

Other threads ask it to act with :meth:`WorkerManager.call` (the callable runs in its thread,
in order) and wait for the state it changes on a condition, always with a deadline.

It is a daemon thread, started with the executor's first worker process: Python joins
non-daemon threads (and ``concurrent.futures``' own) at interpreter exit before the
executor's clean-up runs, and a thread a worker's life depended on must outlive that clean-up.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
import contextlib
import logging
import os
import queue
import selectors
import threading
from typing import Any

_logger = logging.getLogger("waterwave_hpo")
_TICK_S = 1.0  # the longest the selector sleeps: periodic checks (a death without a pid fd)

Handler = Callable[[bool, bool], None]
"""``handler(readable, writable)``, called in the manager's thread for a registered file."""


class WorkerManager:
    """A daemon thread serving registered files from one selector and running calls in order.

    Args:
        name: The thread's name.
    """

    def __init__(self, name: str) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._calls: deque[Callable[[], None]] = deque()
        self._stopping = False
        self._ticks: list[Callable[[], None]] = []
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def in_thread(self) -> bool:
        """Whether the caller is the manager's own thread."""
        return threading.current_thread() is self.thread

    def call(self, function: Callable[[], None]) -> None:
        """Run ``function`` in the manager's thread, after the calls made before it."""
        with self._lock:
            self._calls.append(function)
        self.wake()

    def wake(self) -> None:
        """Make the selector return now (what changed is looked at)."""
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"!")

    # -- the manager's thread only ------------------------------------------------------------

    def register(self, fileobj: Any, handler: Handler, write: bool = False) -> None:
        """Serve ``fileobj`` (readable; also writable with ``write``) with ``handler``."""
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if write else 0)
        self._selector.register(fileobj, events, handler)

    def want_write(self, fileobj: Any, write: bool) -> None:
        """Also serve ``fileobj`` when it is writable (``write``), or no longer."""
        with contextlib.suppress(KeyError, ValueError):
            key = self._selector.get_key(fileobj)
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if write else 0)
            if key.events != events:
                self._selector.modify(fileobj, events, key.data)

    def unregister(self, fileobj: Any) -> None:
        """Stop serving ``fileobj`` (idempotent)."""
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(fileobj)

    def every_tick(self, function: Callable[[], None]) -> None:
        """Run ``function`` at least every second, and after each round of events."""
        self._ticks.append(function)

    def stop(self, timeout_s: float) -> None:
        """End the thread once the calls made before are run (idempotent; waits ``timeout_s``)."""

        def stopping() -> None:
            self._stopping = True

        self.call(stopping)
        if not self.in_thread():
            self.thread.join(timeout=timeout_s)

    def _serve(self) -> None:
        while not self._stopping:
            try:
                self._serve_once()
            except Exception:  # the driver's own bug: say so, keep serving the others
                _logger.exception("The manager of the worker processes failed")
        self._selector.close()
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _serve_once(self) -> None:
        for key, mask in self._selector.select(timeout=_TICK_S):
            if key.data is None:
                with contextlib.suppress(OSError):
                    os.read(self._wake_read, 4096)
                continue
            key.data(bool(mask & selectors.EVENT_READ), bool(mask & selectors.EVENT_WRITE))
        while True:
            with self._lock:
                if not self._calls:
                    break
                function = self._calls.popleft()
            function()
        for tick in list(self._ticks):
            tick()


class Lane:
    """A thread of its own running one slot's slow work (storage calls, tells) in order.

    The manager's thread hands it work with :meth:`put` and never waits for it. Each
    callable runs after those put before it; an exception is logged and the lane goes on.

    Args:
        name: The thread's name.
    """

    def __init__(self, name: str) -> None:
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def put(self, function: Callable[[], None]) -> None:
        """Run ``function`` in the lane, after what was put before."""
        self._work.put(function)

    def stop(self, timeout_s: float) -> None:
        """End the lane once what was put before has run (waits up to ``timeout_s``)."""
        self._work.put(None)
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=timeout_s)

    def _serve(self) -> None:
        while True:
            function = self._work.get()
            if function is None:
                return
            try:
                function()
            except Exception:
                _logger.exception("A worker process's lane failed")
            # Not kept while the lane waits for more: what the work closes over (a trial's
            # record, an optimize's error with its traceback, so the executor) would otherwise
            # outlive it, and a dropped executor's workers with it.
            del function
