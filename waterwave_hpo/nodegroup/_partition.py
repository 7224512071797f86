"""Exact contiguous partition that minimizes the largest part (the NodeGroup cut)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
import itertools
import numbers

from waterwave_hpo import _checks


@dataclass(frozen=True)
class Partition:
    """A cut of ``n`` items into ``k`` contiguous, non-empty parts.

    Attributes:
        bounds: ``k + 1`` ascending indices, ``bounds[0] == 0``, ``bounds[-1] == n``; part ``i``
            is ``sizes[bounds[i]:bounds[i + 1]]``.
        sums: The ``k`` part sums, same unit as ``sizes`` (bytes for NodeGroups).
    """

    bounds: tuple[int, ...]
    sums: tuple[int, ...]

    @property
    def k(self) -> int:
        """Number of parts."""
        return len(self.sums)

    @property
    def largest(self) -> int:
        """The largest part sum, which :func:`partition` minimizes."""
        return max(self.sums)

    def slices(self) -> tuple[slice, ...]:
        """Part ``i`` as ``slice(bounds[i], bounds[i + 1])``."""
        return tuple(slice(a, b) for a, b in itertools.pairwise(self.bounds))


def partition(sizes: Sequence[int], k: int) -> Partition:
    """Cut ``sizes`` into ``k`` contiguous non-empty parts with the smallest largest sum.

    Exact: over all ``C(n - 1, k - 1)`` contiguous partitions, the returned one has the
    minimal largest part sum (Waterwave, IEEE TC 2023, Sec. 4: node groups of similar memory
    size). Bisection on the answer with a greedy feasibility check, ``O(n log(sum(sizes)))``.
    With ``n >= k``, a cut into at most ``k`` parts each ``<= M`` can always be refined into
    exactly ``k`` parts each ``<= M`` (splitting never grows a part), so the minimum over
    exactly ``k`` parts equals the minimum over at most ``k``.

    Args:
        sizes: ``n >= 1`` non-negative integers (bytes), in execution order.
        k: Number of parts, ``1 <= k <= n``.

    Returns:
        The :class:`Partition`. Among optimal cuts, parts are filled greedily from the left.

    >>> partition([4, 1, 1, 2, 3, 3], 3)
    Partition(bounds=(0, 3, 5, 6), sums=(6, 5, 3))

    Raises:
        TypeError: If ``sizes`` holds a non-integer or ``k`` is not an int.
        ValueError: If ``sizes`` is empty or holds a negative value, or ``k`` is not in
            ``[1, len(sizes)]``.
    """
    n = len(sizes)
    if n == 0:
        raise _checks.value_error(
            "sizes", sizes, "is empty", "pass at least one size (bytes) to partition"
        )
    values: list[int] = []
    for i, s in enumerate(sizes):
        if not isinstance(s, numbers.Integral) or isinstance(s, bool):
            raise _checks.type_error(f"sizes[{i}]", s, "an int", "pass sizes in bytes")
        if s < 0:
            raise _checks.value_error(f"sizes[{i}]", s, "must be >= 0", "pass sizes in bytes")
        values.append(int(s))
    if not isinstance(k, numbers.Integral) or isinstance(k, bool):
        raise _checks.type_error("k", k, "an int", f"ask for between 1 and {n} parts")
    if not 1 <= k <= n:
        raise _checks.value_error(
            "k", k, f"must be in [1, len(sizes) = {n}]", f"ask for between 1 and {n} parts"
        )
    k = int(k)
    lo, hi = max(values), sum(values)
    while lo < hi:
        mid = (lo + hi) // 2
        if _parts_needed(values, mid) <= k:
            hi = mid
        else:
            lo = mid + 1
    return _cut(values, k, lo)


def _parts_needed(values: list[int], limit: int) -> int:
    """Fewest contiguous parts with every sum ``<= limit`` (each value ``<= limit``)."""
    parts, current = 1, 0
    for v in values:
        if current + v > limit:
            parts += 1
            current = v
        else:
            current += v
    return parts


def _cut(values: list[int], k: int, limit: int) -> Partition:
    """Exactly ``k`` non-empty parts, each ``<= limit``, greedy from the left."""
    n = len(values)
    bounds = [0]
    current = 0
    for i, v in enumerate(values):
        parts_open = len(bounds)  # parts started so far, including the current one
        must_split = n - i == k - parts_open
        if i > bounds[-1] and (current + v > limit or must_split):
            bounds.append(i)
            current = 0
        current += v
    bounds.append(n)
    sums = tuple(sum(values[a:b]) for a, b in itertools.pairwise(bounds))
    return Partition(tuple(bounds), sums)
