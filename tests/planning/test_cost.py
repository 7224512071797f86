"""The cost model: hand-computed step times and peaks of small plans."""

from __future__ import annotations

import pytest

from waterwave_hpo.planning import Placement
from waterwave_hpo.planning import StepProfile
from waterwave_hpo.planning import Unit
from waterwave_hpo.planning import predict

K, S, R = Placement.KEEP, Placement.SWAP, Placement.RECOMPUTE


def two_units() -> StepProfile:
    return StepProfile(
        units=(
            Unit("a", saved_bytes=1000, input_bytes=100, forward_s=1.0, backward_s=2.0),
            Unit("b", saved_bytes=3000, input_bytes=200, forward_s=1.0, backward_s=2.0),
        ),
        static_bytes=50,
        other_saved_bytes=7,
    )


def test_keep_everything_is_pytorch() -> None:
    p = predict(two_units(), [K, K], 1.0)
    assert p.step_s == pytest.approx(6.0)
    assert p.peak_bytes == 50 + 7 + 1000 + 3000


def test_recompute_keeps_inputs_and_pays_a_second_forward() -> None:
    p = predict(two_units(), [R, R], 1.0)
    assert p.step_s == pytest.approx(8.0)
    # backward of b: both inputs held plus b's recomputed activations
    assert p.peak_bytes == 57 + 100 + 200 + 3000


def test_hidden_swap_costs_no_time_and_frees_its_bytes() -> None:
    prof = two_units()
    p = predict(prof, [S, K], 1e6)  # 1000 bytes take 1 ms, hidden behind b's forward
    assert p.step_s == pytest.approx(6.0)
    assert p.peak_bytes == 57 + 3000 + 1000  # prefetched back at the start of b's backward


def test_slow_swap_shows_the_transfer_not_hidden() -> None:
    # 3000 bytes at 1000 B/s: swap-out 3 s from t=2, prefetch issued at t=2 starts at 5, ends 8
    p = predict(two_units(), [K, S], 1000.0)
    assert p.step_s == pytest.approx(8.0 + 2.0 + 2.0)


def test_choices_must_match_units() -> None:
    with pytest.raises(ValueError, match="2 units"):
        predict(two_units(), [K], 1.0)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s"):
        predict(two_units(), [K, K], 0.0)
