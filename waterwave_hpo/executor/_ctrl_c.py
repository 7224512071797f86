"""Where Ctrl+C may land in the run loop, and the clean-up no Ctrl+C can cut.

Python raises ``KeyboardInterrupt`` at whatever bytecode the main thread is running. Inside a
storage call that leaves the study inconsistent: a trial just created by ``study.ask()`` that no
one tells, or, on an RDB storage, a database connection that SQLAlchemy closes while its cursor
is still reading. SQLite (``sqlite3_close_v2``) keeps such a connection's read lock until the
cursor is freed, and the cursor lives on in the interrupt's traceback: every write of every
thread then waits for SQLite's busy timeout (5 s) and fails with "database is locked". The
clean-up's own tells were such writes, and a second Ctrl+C landing in one of them abandoned the
trials not told yet, RUNNING for ever.

:class:`CtrlC` therefore takes SIGINT for the length of one ``optimize`` call (only in the main
thread, and only while Python's own handler is installed: a user's handler is left alone). The
loop is interruptible only where it waits for an outcome and while a user's callback runs; a
Ctrl+C anywhere else is held and raised at the next such point. Once the loop has been
interrupted the gate is shut: every further Ctrl+C is only counted, the running trials are
told FAIL, and the interrupt is raised when the clean-up has ended.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import gc
import signal
import threading
import traceback
from types import FrameType


class CtrlC:
    """SIGINT for one ``optimize`` call: raised only at the loop's safe points, then held.

    Use as a context manager around the run. Outside the main thread, or with a handler of the
    user's installed, it takes nothing: Ctrl+C then lands where it comes, as without it.

    Attributes:
        received: How many SIGINTs arrived while held (not raised where they landed).
    """

    def __init__(self) -> None:
        self.received = 0
        self._installed = False
        self._open = False  # inside a safe point: a SIGINT raises at once
        self._shielded = False  # clean-up: a SIGINT is only counted
        self._pending = False  # a held SIGINT to raise at the next safe point

    def __enter__(self) -> CtrlC:
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._installed:
            self._installed = False
            if signal.getsignal(signal.SIGINT) == self._on_sigint:
                signal.signal(signal.SIGINT, signal.default_int_handler)
        if exc_info[0] is None and (self._pending or (self._shielded and self.received)):
            # A Ctrl+C held during a clean-up that ended without an error of its own.
            raise KeyboardInterrupt

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if self._open and not self._shielded:
            raise KeyboardInterrupt
        self.received += 1
        if not self._shielded:
            self._pending = True

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A block where Ctrl+C may land (the wait for an outcome, a user's callback).

        Raises:
            KeyboardInterrupt: A Ctrl+C held since the last such block, at its start, or one
                that comes during it, where it lands.
        """
        self.raise_held()
        self._open = True
        try:
            yield
        finally:
            self._open = False

    def raise_held(self) -> None:
        """Raise ``KeyboardInterrupt`` if a Ctrl+C was held since the last safe point."""
        if self._pending and not self._shielded:
            self._pending = False
            raise KeyboardInterrupt

    def shield(self) -> None:
        """From now on hold every Ctrl+C until the context ends (the run's clean-up)."""
        self._shielded = True
        self._pending = False


def release_interrupted_frames(error: BaseException) -> None:
    """Free what the frames of ``error``'s traceback (and its chained errors') hold.

    An interrupt that landed inside a storage call (a user's callback, a handler of the user's)
    leaves the cursor SQLAlchemy could not close in those frames; until it is freed, SQLite
    keeps the file's read lock and no thread can write. The traceback still prints (file, line,
    code); only the frames' locals go. The young generations are collected (what the interrupt
    cut short was made just now; a full collection costs a second on a loaded machine), and
    the run's clean-up collects fully once its threads have stopped.
    """
    seen: set[int] = set()
    stack: list[BaseException | None] = [error]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if current.__traceback__ is not None:
            traceback.clear_frames(current.__traceback__)
        stack += [current.__cause__, current.__context__]
    gc.collect(1)
