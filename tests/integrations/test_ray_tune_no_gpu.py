"""shared_gpu() on a Ray cluster without GPUs: a clear error, not trials PENDING forever."""

from __future__ import annotations

from typing import Any

import pytest

ray = pytest.importorskip("ray")
tune = pytest.importorskip("ray.tune")

import waterwave_hpo as ww  # noqa: E402

RAY_GPUS = 0  # tests/conftest.py's ray_cluster: 2 CPUs, no GPU
pytestmark = [pytest.mark.usefixtures("ray_cluster")]


def _train(config: dict[str, Any]) -> None:
    tune.report({"x": 1.0})


def _train_waiting(config: dict[str, Any]) -> None:  # its own name: Tune registers by name
    tune.report({"x": 1.0})


def test_tuner_with_shared_gpu_on_a_cluster_without_gpus_raises_the_fix() -> None:
    tuner = tune.Tuner(
        tune.with_resources(_train, ww.shared_gpu(4)),
        # Without the check Tune keeps the trials PENDING until this budget ends, and fit()
        # returns without an error: the test then fails instead of hanging.
        tune_config=tune.TuneConfig(num_samples=2, time_budget_s=20),
    )
    with pytest.raises(RuntimeError, match=r"this Ray cluster has no GPU.*on_no_gpu='wait'"):
        tuner.fit()


def test_tune_run_with_resources_per_trial_raises_the_fix_too() -> None:
    with pytest.raises(RuntimeError, match="this Ray cluster has no GPU"):
        tune.run(_train, resources_per_trial=ww.shared_gpu(2), num_samples=1, time_budget_s=20)


def test_on_no_gpu_wait_keeps_tunes_behaviour() -> None:
    analysis = tune.run(
        _train_waiting,
        resources_per_trial=ww.shared_gpu(2, on_no_gpu="wait"),
        num_samples=1,
        time_budget_s=3,
    )
    # The trial never ran (no GPU joined); Tune ended it when the time budget ran out.
    assert [t.last_result.get("x") for t in analysis.trials] == [None]


def test_on_no_gpu_must_be_a_choice() -> None:
    with pytest.raises(ValueError, match="on_no_gpu='never': is not a choice"):
        ww.shared_gpu(on_no_gpu="never")
