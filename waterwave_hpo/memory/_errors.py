"""Errors of the stream-aware pool."""

from __future__ import annotations

import enum


class OOMReason(enum.IntEnum):
    """Why an allocation failed (values of ``ww_status``)."""

    #: The pool's ``capacity_bytes`` would be exceeded even after releasing its cache.
    CAPACITY = 1
    #: The stream's account would exceed its quota.
    QUOTA = 2
    #: The upstream (the device, CuPy) refused a new segment even after releasing the cache.
    UPSTREAM = 3


class PoolOutOfMemoryError(MemoryError):
    """An allocation could not be served. Nothing changed in the pool: no block was taken.

    Attributes:
        nbytes: Bytes requested.
        stream: The requesting stream handle.
        reason: Why it failed.
    """

    def __init__(self, message: str, *, nbytes: int, stream: int, reason: OOMReason) -> None:
        super().__init__(message)
        self.nbytes = nbytes
        self.stream = stream
        self.reason = reason


class PoolBackendError(RuntimeError):
    """The pool's backend failed for a reason other than memory: never an out-of-memory error.

    For CUDA, only ``CUDA_ERROR_OUT_OF_MEMORY`` is out of memory; any other driver error (an
    illegal address left by a kernel, a device-side assert, a lost device) poisons the device's
    context, so retrying the trial beside fewer neighbours cannot help.
    The message carries the driver's own.

    Attributes:
        nbytes: Bytes requested.
        stream: The requesting stream handle.
    """

    def __init__(self, message: str, *, nbytes: int, stream: int) -> None:
        super().__init__(message)
        self.nbytes = nbytes
        self.stream = stream
