"""LaySA inside a Ray Tune sweep: each trial is a Ray Train ``TorchTrainer`` data-parallel group.

Every Tune trial starts a ``TorchTrainer`` of ``--workers`` CPU workers on gloo (NCCL on GPUs
with ``--use-gpu``) that trains an MLP on scikit-learn's digits with LaySA's sparse gradients;
Tune searches the density and the learning rate and reads each trial's accuracy through Ray
Train's ``TuneReportCallback``. A worker that dies fails its trial with the reason;
``--max-failures N`` lets Ray Train restart the group::

    python experiments/laysa_ray_tune.py --samples 4 --workers 2 --epochs 5

Run it from outside the source checkout's root (Ray puts the driver's working directory first
on its workers' ``sys.path``), e.g. ``cd experiments && python laysa_ray_tune.py``.

From Optuna the same works with no new code: call ``TorchTrainer(...).fit()`` inside the
objective and return the metric (each trial then is one Ray Train group); or run
``torch.multiprocessing.spawn`` of a gloo/NCCL group per trial. Ray Tune is the cleaner
path: it schedules the groups' resources and fails a trial whose worker dies.
"""

from __future__ import annotations

import argparse
from pathlib import Path
import tempfile
from typing import Any


def train_worker(
    config: dict[str, Any],
    *,
    rank: int,
    world_size: int,
    device: Any,
    prepare_model: Any,
    report: Any,
) -> None:
    """One data-parallel worker's training on its shard of digits, LaySA attached.

    Ray-free, so a test can run it on the CPU in a one-process gloo group. The model is on
    ``device`` (``prepare_model`` moves and wraps it, as Ray Train's does); every batch is moved
    there before the model sees it, and predictions come back to the host (``.cpu()``) before
    NumPy reads them.

    Args:
        config: ``lr``, ``density``, ``epochs``.
        rank: This worker's rank; it trains on every ``world_size``-th example from it.
        world_size: Workers in the group.
        device: The model's device (``ray.train.torch.get_device()``: a GPU with ``--use-gpu``).
        prepare_model: ``net -> DDP model on device`` (``ray.train.torch.prepare_model``).
        report: Called with each epoch's metrics (``ray.train.report``).
    """
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    import torch

    from waterwave_hpo.distributed import laysa

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.2, random_state=0, stratify=digits.target
    )
    x_train_t = torch.from_numpy(x_train[rank::world_size])
    y_train_t = torch.from_numpy(y_train[rank::world_size]).long()
    x_test_t = torch.from_numpy(x_test)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    model = prepare_model(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    attached = laysa(model, density=config["density"], optimizer=optimizer, warmup_steps=5)
    generator = torch.Generator().manual_seed(1)
    batch = 32
    for epoch in range(config["epochs"]):
        order = torch.randperm(len(x_train_t), generator=generator)
        for step in range(len(x_train_t) // batch):
            index = order[step * batch : (step + 1) * batch]
            inputs, targets = x_train_t[index].to(device), y_train_t[index].to(device)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
        with torch.no_grad():
            predicted = model(x_test_t.to(device)).argmax(1).cpu().numpy()
        report(
            {
                "epoch": epoch,
                "accuracy": float((predicted == y_test).mean()),
                "bytes_sent_per_step": attached.state.bytes_sent_last_step,
                "extra_memory_bytes": attached.state.ledger.peak_bytes,
            }
        )


def train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: :func:`train_worker` on the device Ray Train gives it."""
    from ray import train
    import ray.train.torch

    context = train.get_context()
    train_worker(
        config,
        rank=context.get_world_rank(),
        world_size=context.get_world_size(),
        device=ray.train.torch.get_device(),
        prepare_model=ray.train.torch.prepare_model,
        report=train.report,
    )


def tune_trial(config: dict[str, Any]) -> None:
    """One Tune trial: a ``TorchTrainer`` whose reports reach Tune."""
    from ray.train import FailureConfig
    from ray.train import RunConfig
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    TorchTrainer(
        train_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(
            num_workers=config["workers"],
            use_gpu=config["use_gpu"],
            resources_per_worker={"CPU": config["cpus_per_worker"]},
        ),
        run_config=RunConfig(
            storage_path=config["storage"],
            callbacks=[TuneReportCallback()],
            failure_config=FailureConfig(max_failures=config["max_failures"]),
        ),
    ).fit()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cpus-per-worker", type=float, default=0.5)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--max-failures", type=int, default=0)
    parser.add_argument("--storage", type=Path, default=Path(tempfile.gettempdir()) / "laysa-tune")
    args = parser.parse_args(argv)

    import ray
    from ray import tune

    ray.init(address="local", include_dashboard=False)
    try:
        tuner = tune.Tuner(
            tune.with_resources(tune_trial, {"CPU": 0.25}),
            param_space={
                "density": tune.choice([0.01, 0.05, 0.1]),
                "lr": tune.loguniform(0.02, 0.2),
                "epochs": args.epochs,
                "workers": args.workers,
                "cpus_per_worker": args.cpus_per_worker,
                "use_gpu": args.use_gpu,
                "max_failures": args.max_failures,
                "storage": str(args.storage / "train"),
            },
            tune_config=tune.TuneConfig(
                num_samples=args.samples, metric="accuracy", mode="max", max_concurrent_trials=1
            ),
            run_config=tune.RunConfig(storage_path=str(args.storage / "tune")),
        )
        grid = tuner.fit()
        best = grid.get_best_result()
        print("best config:", {k: best.config[k] for k in ("density", "lr")})
        print("best metrics:", {k: best.metrics[k] for k in ("accuracy", "bytes_sent_per_step")})
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
