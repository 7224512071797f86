"""Which process owns something (a journal lock, a running trial), and whether it is gone."""

from __future__ import annotations

from dataclasses import dataclass
import os
import socket
from typing import Any

import psutil

# Start times are floats from the OS clock; two reads of one process agree far closer than this.
_START_TIME_TOLERANCE_S = 0.5


@dataclass(frozen=True)
class ProcessIdentity:
    """A process, named so that a recycled pid is not mistaken for it.

    Attributes:
        hostname: ``socket.gethostname()`` of the machine it runs on.
        pid: Its process id on that machine.
        start_time_s: When it started, in seconds since the epoch (``psutil.Process.create_time``).
    """

    hostname: str
    pid: int
    start_time_s: float

    @property
    def key(self) -> str:
        """A string naming the process, for attribute keys: ``host:pid:start``."""
        return f"{self.hostname}:{self.pid}:{self.start_time_s:.2f}"

    def describe(self) -> str:
        """Human-readable: ``pid 123 on host h``."""
        return f"pid {self.pid} on host {self.hostname}"

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable dict (an Optuna attribute value)."""
        return {"hostname": self.hostname, "pid": self.pid, "start_time_s": self.start_time_s}

    @staticmethod
    def from_json(value: object) -> ProcessIdentity | None:
        """The identity :meth:`to_json` wrote, or ``None`` if ``value`` is not one."""
        if not isinstance(value, dict):
            return None
        try:
            return ProcessIdentity(
                hostname=str(value["hostname"]),
                pid=int(value["pid"]),
                start_time_s=float(value["start_time_s"]),
            )
        except (KeyError, TypeError, ValueError):
            return None

    def is_on_this_host(self) -> bool:
        """Whether it runs (or ran) on this machine, where its pid can be checked."""
        return self.hostname == socket.gethostname()

    def is_gone(self) -> bool:
        """Whether this process has exited (only decidable on this host).

        A pid that now belongs to a process started at another time counts as gone.

        Raises:
            ValueError: If the process runs on another host.
        """
        if not self.is_on_this_host():
            raise ValueError(
                f"{self.describe()} runs on another host; its liveness is known only by heartbeat."
            )
        try:
            process = psutil.Process(self.pid)
            started = process.create_time()
            if process.status() == psutil.STATUS_ZOMBIE:  # exited, not yet reaped
                return True
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:  # access denied: it exists
            return False
        return bool(abs(started - self.start_time_s) > _START_TIME_TOLERANCE_S)


def this_process() -> ProcessIdentity:
    """The identity of the calling process."""
    pid = os.getpid()
    return ProcessIdentity(
        hostname=socket.gethostname(), pid=pid, start_time_s=psutil.Process(pid).create_time()
    )
