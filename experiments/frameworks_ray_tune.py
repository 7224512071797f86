"""Example: Ray Tune trials that share a GPU, with ``tune.Tuner``.

``tune.Tuner(tune.with_resources(resources.wrap(train_fn), resources))``: Ray places
``--per-gpu`` trials on each GPU and each holds a memory lease from the GPU's broker. Without a
GPU, ``--logical-gpus 1`` starts a local Ray with one logical GPU (placement is real, the work
runs on the CPU); on a Ray cluster without GPUs, ``shared_gpu()`` raises when Tune places the
first trial::

    cd experiments && python frameworks_ray_tune.py --samples 4 --per-gpu 2 --logical-gpus 1

Run it from outside the source checkout's root (Ray puts the driver's working directory first
on its workers' ``sys.path``).
"""

from __future__ import annotations

import argparse
from typing import Any


def train_fn(config: dict[str, Any]) -> None:
    """An MLP on digits for a few epochs, reporting accuracy and the GPU's leases to Tune."""
    from ray import tune
    from sklearn.datasets import load_digits
    import torch
    from torch import nn
    from waterwave_hpo.integrations.ray_tune import lease_stats

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(
        nn.Linear(64, config["hidden"]), nn.ReLU(), nn.Linear(config["hidden"], 10)
    )
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    generator = torch.Generator().manual_seed(0)
    for epoch in range(config["epochs"]):
        for batch in torch.randperm(1500, generator=generator).split(64):
            loss = nn.functional.cross_entropy(model(x[batch].to(device)), y[batch].to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            accuracy = (model(x[1500:].to(device)).argmax(1).cpu() == y[1500:]).float().mean()
        tune.report({"accuracy": float(accuracy), "epoch": epoch, "leases": lease_stats().n_held})


def main(argv: list[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--per-gpu", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--logical-gpus", type=int, default=None)
    args = parser.parse_args(argv)

    import ray
    from ray import tune

    import waterwave_hpo as ww

    if args.logical_gpus is not None:
        # "local": a new instance with the logical GPUs, never a cluster found on this machine.
        ray.init(
            address="local",
            num_gpus=args.logical_gpus,
            include_dashboard=False,
            log_to_driver=False,
        )
    resources = ww.shared_gpu(trials_per_gpu=args.per_gpu, cpus_per_trial=0.5)
    tuner = tune.Tuner(
        tune.with_resources(resources.wrap(train_fn), resources),
        param_space={
            "lr": tune.loguniform(1e-3, 0.5),
            "hidden": tune.choice([16, 32, 64]),
            "epochs": args.epochs,
        },
        tune_config=tune.TuneConfig(
            metric="accuracy", mode="max", num_samples=args.samples, reuse_actors=True
        ),
    )
    results = tuner.fit()
    best = results.get_best_result()
    print(f"best accuracy {best.metrics['accuracy']:.3f} {best.config}")
    print(
        "errors:",
        len(results.errors),
        "leases held at once, max:",
        max(r.metrics.get("leases", 0) for r in results),
    )
    return results


if __name__ == "__main__":
    main()
