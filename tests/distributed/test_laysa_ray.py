"""LaySA where trials run: Ray Train's TorchTrainer (CPU workers on gloo) inside a Ray Tune trial,
on a local Ray instance. A worker that dies fails its Tune trial with the reason."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

ray = pytest.importorskip("ray")
tune = pytest.importorskip("ray.tune")
train = pytest.importorskip("ray.train")
ray_train_torch = pytest.importorskip("ray.train.torch")

RAY_GPUS = 0  # tests/conftest.py's ray_cluster: 2 CPUs, no GPU
pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("ray_cluster"),
]


def _train_loop(config: dict[str, Any]) -> None:
    import torch

    from waterwave_hpo.distributed import laysa

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    model = ray_train_torch.prepare_model(net)  # DistributedDataParallel on the gloo group
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    attached = laysa(model, density=config["density"], optimizer=optimizer)
    rank = train.get_context().get_world_rank()
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 16, generator=generator)
    y = (x[:, :4].argmax(1)).long()  # a learnable rule
    for step in range(config["steps"]):
        if config["die_at_step"] == step and rank == 1:
            os._exit(3)  # the worker process dies
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        train.report(
            {
                "loss": loss.item(),
                "step": step,
                "world_size": train.get_context().get_world_size(),
                "bytes_sent": attached.state.bytes_sent_last_step,
                "extra_memory_bytes": attached.state.ledger.peak_bytes,
            }
        )


def _tune_trial(config: dict[str, Any]) -> None:
    from ray.train import FailureConfig
    from ray.train import RunConfig
    from ray.train import ScalingConfig
    from ray.tune.integration.ray_train import TuneReportCallback

    trainer = ray_train_torch.TorchTrainer(
        _train_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(
            num_workers=2, use_gpu=False, resources_per_worker={"CPU": 0.25}
        ),
        run_config=RunConfig(
            name=f"laysa-die-{config['die_at_step']}",
            storage_path=config["storage"],
            callbacks=[TuneReportCallback()],
            failure_config=FailureConfig(max_failures=0),
        ),
    )
    trainer.fit()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One Tune run of two trials, each a TorchTrainer of 2 CPU workers on gloo: one trains,
    one loses its rank-1 worker at step 2."""
    tmp_path = tmp_path_factory.mktemp("tune")
    tuner = tune.Tuner(
        tune.with_resources(_tune_trial, {"CPU": 0.25}),
        param_space={
            "storage": str(tmp_path / "train"),
            "density": 0.05,
            "steps": 6,
            "die_at_step": tune.grid_search([None, 2]),
        },
        run_config=tune.RunConfig(storage_path=str(tmp_path / "tune"), verbose=0),
        tune_config=tune.TuneConfig(max_concurrent_trials=2),
    )
    grid = tuner.fit()
    free_cpus = _wait_for_free_cpus(2.0)
    by_case = {r.config["die_at_step"]: r for r in grid}
    return by_case, free_cpus


def _wait_for_free_cpus(expected: float, timeout_s: float = 30.0) -> float:
    deadline = time.monotonic() + timeout_s
    free = 0.0
    while time.monotonic() < deadline:
        free = ray.available_resources().get("CPU", 0.0)
        if free >= expected:
            break
        time.sleep(0.5)
    return free


def test_torch_trainer_workers_in_a_tune_trial_train_with_laysa(results: Any) -> None:
    by_case, free_cpus = results
    result = by_case[None]
    assert result.error is None
    assert result.metrics["world_size"] == 2
    assert result.metrics["step"] == 5
    # a sparse step: per layer max(1, floor(0.05 * numel)) values + int32 indices
    numels = [16 * 64, 64, 64 * 4, 4]
    ks = [max(1, int(0.05 * n)) for n in numels]
    assert result.metrics["bytes_sent"] == sum(ks) * 8
    # |g| of the largest layer, top-k values + int64 indices, send, receive from 2 ranks
    expected = max(numels) * 4 + max(ks) * 12 + sum(ks) * 8 + 2 * sum(ks) * 8
    assert result.metrics["extra_memory_bytes"] == expected
    history = result.metrics_dataframe
    assert history["loss"].iloc[-1] < history["loss"].iloc[0]
    assert free_cpus >= 2.0  # nothing left running


def test_a_dead_worker_fails_the_tune_trial_with_the_reason(results: Any) -> None:
    by_case, free_cpus = results
    error = by_case[2].error
    assert error is not None
    reason = str(error).lower()
    assert any(word in reason for word in ("exit", "died", "worker", "actor"))
    assert free_cpus >= 2.0  # nothing left running
