"""Memory leases for the processes that share one GPU (the per-GPU broker's book-keeping).

Ray Tune runs every trial in its own process; fractional GPUs (``{"GPU": 0.25}``) let Ray place
several on one GPU but leave memory to the user. The trials on one GPU instead ask a per-GPU
broker for a *lease* of device memory before they train; the broker grants leases first come,
first served while their sum fits the GPU's budget, so the trials' peaks do not collide (the
admission idea of Waterwave, IEEE TC 2023, Sec. 4, across processes instead of threads). A
lease that is neither renewed nor released within its time-to-live (the process died, or Tune
stopped the trial) expires, and its bytes go to the next in line.

This module is the broker's logic, without Ray, so that it is tested directly. It lives beside
the pool, below the executor and the cluster: the cluster's broker actor (``shared_gpu()``) and
the executor's worker processes (``isolation="process"``, where the driver keeps one book per
device) both use it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
import math
import time

from waterwave_hpo import _checks


@dataclass(frozen=True)
class MemoryLease:
    """Device memory a trial process may use while it holds the lease.

    Attributes:
        holder: Who holds it (a unique id per lease request).
        nbytes: The bytes granted; ``None`` when the GPU has no known budget (nothing to
            coordinate: no CUDA and no ``memory_budget_bytes``).
        budget_bytes: The GPU's budget all leases share, or ``None``.
        waited_s: Seconds between the request and the grant.
    """

    holder: str
    nbytes: int | None
    budget_bytes: int | None
    waited_s: float


@dataclass(frozen=True)
class LeaseStats:
    """One GPU's leases at one moment.

    Attributes:
        n_held: Leases granted and not yet released or expired.
        n_waiting: Requests waiting for room.
        granted_bytes: Bytes held by the granted leases.
        budget_bytes: The GPU's budget, or ``None`` (no coordination).
    """

    n_held: int
    n_waiting: int
    granted_bytes: int
    budget_bytes: int | None


@dataclass
class _Request:
    nbytes: int | None
    requested_s: float
    seen_s: float


@dataclass
class _Held:
    lease: MemoryLease
    seen_s: float


class LeaseBook:
    """The leases of one GPU: a FIFO queue of requests and the leases granted.

    Args:
        budget_bytes: The bytes all leases may add up to (> 0), or ``None``: no budget, every
            request is granted at once.
        trials_per_gpu: How a request without ``nbytes`` is sized: ``budget_bytes //
            trials_per_gpu``; ``None`` ("auto"): the median measured peak of released leases
            plus 10 %, or the whole budget while nothing is measured yet (the first trial runs
            alone and measures).
        ttl_s: A request or lease not touched (polled, renewed) for this many seconds expires.
        clock: Seconds, monotonic (tests pass their own).

    Raises:
        ValueError: If ``budget_bytes``, ``trials_per_gpu`` or ``ttl_s`` is not > 0.
    """

    def __init__(
        self,
        budget_bytes: int | None,
        trials_per_gpu: int | None,
        ttl_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.budget_bytes: int | None = None
        self.trials_per_gpu: int | None = None
        self.ttl_s = 0.0
        self.configure(budget_bytes, trials_per_gpu, ttl_s)
        self._clock = clock
        self._waiting: OrderedDict[str, _Request] = OrderedDict()
        self._held: dict[str, _Held] = {}
        self._peaks: deque[int] = deque(maxlen=32)

    def configure(
        self, budget_bytes: int | None, trials_per_gpu: int | None, ttl_s: float | None = None
    ) -> None:
        """Set the budget, the sizing rule and the time-to-live.

        Set the budget, the sizing rule and (unless ``None``) the time-to-live; leases
        already granted are kept. Holders learn a new time-to-live from :meth:`renew`.

        Raises:
            ValueError: If ``budget_bytes``, ``trials_per_gpu`` or ``ttl_s`` is not > 0.
        """
        if ttl_s is not None and not ttl_s > 0:
            raise _checks.value_error("ttl_s", ttl_s, "must be > 0", "pass seconds")
        if budget_bytes is not None and budget_bytes <= 0:
            raise _checks.value_error(
                "budget_bytes", budget_bytes, "must be > 0", "pass bytes, or None"
            )
        if trials_per_gpu is not None and trials_per_gpu <= 0:
            raise _checks.value_error(
                "trials_per_gpu", trials_per_gpu, "must be > 0", "pass a count, or None ('auto')"
            )
        self.budget_bytes = budget_bytes
        self.trials_per_gpu = trials_per_gpu
        if ttl_s is not None:
            self.ttl_s = float(ttl_s)

    @property
    def granted_bytes(self) -> int:
        """Bytes held by the current leases."""
        return sum(h.lease.nbytes or 0 for h in self._held.values())

    @property
    def n_held(self) -> int:
        """How many leases are held now."""
        return len(self._held)

    @property
    def n_waiting(self) -> int:
        """How many requests wait for a lease now."""
        return len(self._waiting)

    def holders(self) -> list[str]:
        """The holders of the leases held and of the requests waiting now."""
        return [*self._held, *self._waiting]

    def request(self, holder: str, nbytes: int | None) -> None:
        """Queue a request for ``nbytes`` (``None``: sized by the book). Idempotent per holder."""
        if nbytes is not None and nbytes <= 0:
            raise _checks.value_error(
                "nbytes", nbytes, "must be > 0", "pass bytes, or None to let it be sized"
            )
        now = self._clock()
        if holder not in self._held and holder not in self._waiting:
            self._waiting[holder] = _Request(nbytes, now, now)

    def poll(self, holder: str) -> MemoryLease | None:
        """Touch ``holder``'s request or lease; return its lease once granted, else ``None``.

        Raises:
            KeyError: If ``holder`` has neither a request nor a lease (it expired, or was
                never made).
        """
        now = self._clock()
        self._touch(holder, now)
        self._expire(now)
        self._grant(now)
        if holder in self._held:
            return self._held[holder].lease
        if holder in self._waiting:
            return None
        raise KeyError(f"No lease or request for {holder!r}; it expired after {self.ttl_s} s.")

    def renew(self, holder: str) -> float | None:
        """Keep ``holder``'s lease alive.

        Returns:
            The time-to-live in seconds (renew again well within it), or ``None`` if the lease
            has expired already.
        """
        now = self._clock()
        self._touch(holder, now)
        self._expire(now)
        return self.ttl_s if holder in self._held else None

    def release(self, holder: str, peak_bytes: int | None = None) -> None:
        """Give the lease back; ``peak_bytes`` (measured by the holder) sizes "auto" leases."""
        self._waiting.pop(holder, None)
        if self._held.pop(holder, None) is not None and peak_bytes is not None:
            self._peaks.append(int(peak_bytes))
        now = self._clock()
        self._expire(now)
        self._grant(now)

    def stats(self) -> LeaseStats:
        """The leases now (expired ones are dropped first)."""
        self._expire(self._clock())
        return LeaseStats(self.n_held, self.n_waiting, self.granted_bytes, self.budget_bytes)

    def _touch(self, holder: str, now: float) -> None:
        if holder in self._held:
            self._held[holder].seen_s = now
        elif holder in self._waiting:
            self._waiting[holder].seen_s = now

    def _expire(self, now: float) -> None:
        for holder in [h for h, held in self._held.items() if now - held.seen_s > self.ttl_s]:
            del self._held[holder]
        for holder in [h for h, r in self._waiting.items() if now - r.seen_s > self.ttl_s]:
            del self._waiting[holder]

    def _size(self, nbytes: int | None) -> int | None:
        budget = self.budget_bytes
        if budget is None:
            return nbytes
        if nbytes is not None:
            return min(nbytes, budget)
        if self.trials_per_gpu is not None:
            return budget // self.trials_per_gpu
        if not self._peaks:
            return budget
        peaks = sorted(self._peaks)
        return min(budget, math.ceil(peaks[len(peaks) // 2] * 1.1))

    def _grant(self, now: float) -> None:
        # First come, first served: a big request at the head waits for room and is not
        # overtaken (no starvation). A request alone on the GPU is always granted.
        while self._waiting:
            holder, request = next(iter(self._waiting.items()))
            size = self._size(request.nbytes)
            fits = (
                self.budget_bytes is None
                or not self._held
                or self.granted_bytes + (size or 0) <= self.budget_bytes
            )
            if not fits:
                return
            del self._waiting[holder]
            lease = MemoryLease(holder, size, self.budget_bytes, now - request.requested_s)
            self._held[holder] = _Held(lease, now)
