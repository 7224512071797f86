"""partition(): exact against brute force, and its argument errors."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import pytest

from waterwave_hpo.nodegroup import partition


def brute_force_largest(sizes: list[int], k: int) -> int:
    n = len(sizes)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        largest = max(sum(sizes[a:b]) for a, b in itertools.pairwise(bounds))
        best = largest if best is None else min(best, largest)
    assert best is not None
    return best


@st.composite
def sizes_and_k(draw: st.DrawFn) -> tuple[list[int], int]:
    sizes = draw(st.lists(st.integers(0, 1000), min_size=1, max_size=10))
    k = draw(st.integers(1, len(sizes)))
    return sizes, k


@settings(max_examples=300, deadline=None)
@given(sizes_and_k())
def test_partition_is_optimal_and_well_formed(case: tuple[list[int], int]) -> None:
    sizes, k = case
    p = partition(sizes, k)
    assert p.k == k
    assert p.bounds[0] == 0 and p.bounds[-1] == len(sizes)
    assert all(a < b for a, b in itertools.pairwise(p.bounds)), "parts must be non-empty"
    assert p.sums == tuple(sum(sizes[s]) for s in p.slices())
    assert p.largest == brute_force_largest(sizes, k)


def test_partition_known_case() -> None:
    p = partition([7, 2, 5, 10, 8], 2)
    assert p.largest == 18
    assert p.bounds == (0, 3, 5)


@pytest.mark.parametrize(
    ("k", "error"),
    [(0, ValueError), (-1, ValueError), (4, ValueError), (1.5, TypeError), (True, TypeError)],
)
def test_bad_k_names_k(k: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=rf"^k={k!r}: .*; ask for between 1 and 3 parts"):
        partition([1, 2, 3], k)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("sizes", "error"), [([1, -2], ValueError), ([1.5, 2], TypeError), (["a"], TypeError)]
)
def test_bad_sizes_name_the_item(sizes: list[object], error: type[Exception]) -> None:
    with pytest.raises(error, match=r"^sizes\[\d\]=.*; pass sizes in bytes"):
        partition(sizes, 1)  # type: ignore[arg-type]


def test_empty_sizes() -> None:
    with pytest.raises(ValueError, match=r"^sizes=\[\]: is empty"):
        partition([], 1)
