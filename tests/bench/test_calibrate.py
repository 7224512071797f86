"""Light and high settings: what the paper calls high memory demand, by construction."""

from __future__ import annotations

import pytest

from waterwave_hpo.bench import Setting
from waterwave_hpo.bench import Workload
from waterwave_hpo.bench import WorkloadSpec
from waterwave_hpo.bench import draw_params
from waterwave_hpo.bench import fit_batches
from waterwave_hpo.bench import profile_trial


def top(profiles, k):  # sum of the k largest solo peaks, bytes
    return sum(sorted((p.peak_bytes for p in profiles), reverse=True)[:k])


@pytest.mark.parametrize("k", [2, 4])
def test_virtual_capacity_makes_light_fit_and_high_not(k: int) -> None:
    params = draw_params(Workload.DIGITS, 4, seed=0)
    base = WorkloadSpec(Workload.DIGITS, Setting.LIGHT, batch_size=32, steps=1)
    light, high, cap, lp, hp = fit_batches(base, params, k, None)
    assert (light.setting, high.setting) == (Setting.LIGHT, Setting.HIGH)
    assert high.batch_size > light.batch_size
    assert top(lp, k) <= cap  # light: the k trials fit together
    assert max(p.peak_bytes for p in hp) <= cap  # high: each fits alone ...
    assert top(hp, k) > cap  # ... but k of them do not


def test_given_capacity_shrinks_light_and_sizes_high() -> None:
    params = draw_params(Workload.GPT, 3, seed=0)
    base = WorkloadSpec(Workload.GPT, Setting.LIGHT, batch_size=16, steps=1, seq_len=16)
    solo = max(profile_trial(base, p).peak_bytes for p in params)
    cap = int(solo * 1.5)  # two base-batch trials do not fit in 80% of it
    light, _, got, lp, hp = fit_batches(base, params, 2, cap)
    assert got == cap
    assert light.batch_size < 16
    assert top(lp, 2) <= 0.8 * cap
    assert max(p.peak_bytes for p in hp) <= cap
    assert top(hp, 2) > cap * 0.9
