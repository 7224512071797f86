"""The step ledger: device bytes of saved activations a planned model holds, and their peak."""

from __future__ import annotations

from collections.abc import Hashable
import threading


class StepLedger:
    """Counts bytes held under keys (a storage counts once however often it is held).

    Thread-safe: on CUDA, backward (where bytes are released) runs on autograd's worker thread.
    The plan's hooks add a storage when autograd saves it on the device (or prefetches it back)
    and release it when autograd drops it; a recompute adds its transient for the unit's
    backward. ``peak_bytes`` is what the planners' predicted peak bounds (plus static bytes).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[Hashable, tuple[int, int]] = {}  # key -> (count, bytes)
        self.current_bytes = 0
        self.peak_bytes = 0

    def add(self, key: Hashable, nbytes: int) -> None:
        """Hold ``nbytes`` under ``key`` (counted once while any holder of ``key`` remains)."""
        with self._lock:
            count, size = self._held.get(key, (0, nbytes))
            if count == 0:
                self.current_bytes += size
                self.peak_bytes = max(self.peak_bytes, self.current_bytes)
            self._held[key] = (count + 1, size)

    def release(self, key: Hashable) -> None:
        """Drop one holder of ``key``; its bytes leave when the last holder does."""
        with self._lock:
            entry = self._held.get(key)
            if entry is None:
                return
            count, size = entry
            if count <= 1:
                del self._held[key]
                self.current_bytes -= size
            else:
                self._held[key] = (count - 1, size)

    def reset_peak(self) -> None:
        """Start a new peak from the current bytes (call between steps)."""
        with self._lock:
            self.peak_bytes = self.current_bytes
