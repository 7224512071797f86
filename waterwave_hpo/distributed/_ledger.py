"""Exact byte accounting of the buffers a gradient-communication hook holds."""

from __future__ import annotations

from dataclasses import dataclass
import threading

import torch


@dataclass
class CommMemoryLedger:
    """Current and peak bytes of the tensors a communication hook has allocated for itself.

    Counts only the hook's own buffers (residuals, selection scratch, send and receive
    buffers), by ``tensor.nbytes`` at allocation and release, so the figures are exact and
    independent of the allocator. Temporaries inside library calls (e.g. ``torch.topk``'s
    workspace) are not counted; DDP's own gradient buckets are not counted either (dense DDP
    holds them too).

    Attributes:
        current_bytes: Bytes held now.
        peak_bytes: Largest ``current_bytes`` seen since construction or ``reset_peak()``.
    """

    current_bytes: int = 0
    peak_bytes: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()  # gloo completes futures on its own threads

    def allocate(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count ``tensor`` as held and return it."""
        with self._lock:
            self.current_bytes += tensor.nbytes
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return tensor

    def release(self, tensor: torch.Tensor) -> None:
        """Count ``tensor`` as no longer held (the caller drops its reference)."""
        with self._lock:
            self.current_bytes -= tensor.nbytes

    def reset_peak(self) -> None:
        """Start a new peak window at the current level."""
        with self._lock:
            self.peak_bytes = self.current_bytes

    def __getstate__(self) -> dict[str, int]:
        return {"current_bytes": self.current_bytes, "peak_bytes": self.peak_bytes}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.current_bytes = state["current_bytes"]
        self.peak_bytes = state["peak_bytes"]
        self._lock = threading.Lock()
