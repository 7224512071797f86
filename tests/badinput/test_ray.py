"""Ray cases, sharing one local Ray without GPUs: advice that leads somewhere."""

from __future__ import annotations

import optuna
import pytest

import waterwave_hpo as ww

pytest.importorskip("ray")
RAY_GPUS = 0  # tests/conftest.py: the module's local Ray has no GPU
pytestmark = [pytest.mark.usefixtures("ray_cluster")]


def test_ray_executor_n_hosts_without_gpus_advises_cpu_hosts_not_a_refused_value() -> None:
    study = optuna.create_study()
    match = r"n_hosts=3 .* has none\. Pass num_gpus_per_host=0"
    with pytest.raises(RuntimeError, match=match) as e:
        ww.RayExecutor(n_hosts=3).optimize(study, lambda t: 1.0, n_trials=1)
    assert "n_hosts <= 0" not in str(e.value) and "'auto'" not in str(e.value)
    assert study.trials == []


def test_tune_hosts_without_gpus_does_not_advise_n_hosts() -> None:
    pytest.importorskip("ray.tune")
    for n_hosts in (3, None):
        with (
            pytest.raises(RuntimeError, match=r"no GPU.*ray\.init\(num_gpus=N\)") as caught,
            ww.tune_hosts(n_hosts=n_hosts),
        ):
            pass
        assert "n_hosts <= 0" not in str(caught.value)
        assert "pass n_hosts=N" not in str(caught.value)
