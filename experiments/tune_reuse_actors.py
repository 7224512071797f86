"""Ray Tune's ``reuse_actors`` with ``shared_gpu()`` and ``tune_hosts()``: what a new trial
process costs.

Each Tune trial is a Ray actor, a process of its own: with ``reuse_actors=False`` (Tune's
default) every trial starts one (Ray's worker, ``ray.tune``, and with ``shared_gpu()`` torch and
the trainable's imports), with ``reuse_actors=True`` a finished trial's process runs the next
trial. Side by side in one Ray instance (2 CPUs, 1 logical GPU: the work runs on the CPU), the
same ``--trials`` small trials (a linear model, ``--steps`` SGD steps each) with each setting,
through ``shared_gpu(trials_per_gpu=2)`` and ``tune_hosts(trials_per_gpu=2)``:

* ``wall_s``: seconds of ``Tuner.fit()``;
* ``cpu_s``: the machine's busy CPU-seconds during it (``psutil.cpu_times``: every process, Ray's
  included), which on a small machine is what the trials' start-up takes from the training;
* ``processes``: distinct trial processes (pids the trials reported);
* ``errors``: trials that did not end TERMINATED.

Settings alternate, ``--rounds`` times each, so that Ray's and Tune's first-use costs do not
fall on one setting only. Run:
``python experiments/tune_reuse_actors.py --out experiments/results/<date>-tune-reuse-actors/``
(from outside the source checkout's root: Ray puts the driver's directory first on its
workers' ``sys.path``). Writes ``tune_reuse_actors.json`` (machine, load before and after,
versions, every row) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import platform
import tempfile
import time
from typing import Any

os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
os.environ.setdefault("RAY_enable_worker_prestart", "0")


def _busy_cpu_s() -> float:
    import psutil  # Ray's own dependency

    times = psutil.cpu_times()  # the machine's, every process included
    return float(times.user + times.nice + times.system + times.irq + times.softirq + times.steal)


def _train(config: dict[str, Any]) -> None:
    from ray import tune
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(32, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    x, y = torch.randn(256, 32), torch.randn(256, 1)
    for _ in range(config["steps"]):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        tune.report({"loss": float(loss), "pid": os.getpid()})


def _fit(design: str, reuse: bool, trials: int, steps: int) -> dict[str, Any]:
    from ray import tune

    import waterwave_hpo as ww

    space = {"lr": tune.grid_search([0.01 * (i + 1) for i in range(trials)]), "steps": steps}
    run_config = tune.RunConfig(storage_path=tempfile.mkdtemp(), verbose=0)
    start_cpu, start = _busy_cpu_s(), time.monotonic()
    if design == "shared_gpu":
        resources = ww.shared_gpu(trials_per_gpu=2)
        grid = tune.Tuner(
            tune.with_resources(resources.wrap(_train), resources),
            param_space=space,
            tune_config=tune.TuneConfig(reuse_actors=reuse),
            run_config=run_config,
        ).fit()
    else:
        with ww.tune_hosts(trials_per_gpu=2, cpus_per_trial=0.5) as hosts:
            grid = tune.Tuner(
                tune.with_resources(hosts.wrap(_train), hosts.resources),
                param_space=space,
                tune_config=tune.TuneConfig(
                    reuse_actors=reuse, max_concurrent_trials=hosts.max_concurrent_trials
                ),
                run_config=run_config,
            ).fit()
    wall, cpu = time.monotonic() - start, _busy_cpu_s() - start_cpu
    return {
        "design": design,
        "reuse_actors": reuse,
        "trials": trials,
        "steps": steps,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 1),
        "processes": len({r.metrics["pid"] for r in grid if r.metrics}),
        "errors": grid.num_errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="results folder (created)")
    parser.add_argument("--trials", type=int, default=8, help="trials per fit")
    parser.add_argument("--steps", type=int, default=5, help="SGD steps (reports) per trial")
    parser.add_argument("--rounds", type=int, default=2, help="fits per design and setting")
    args = parser.parse_args()

    import ray
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    ray.init(
        address="local",
        num_cpus=2,
        num_gpus=1,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=256 << 20,
    )
    rows = []
    try:
        for design in ("shared_gpu", "tune_hosts"):
            for round_index in range(args.rounds):
                order = (False, True) if round_index % 2 == 0 else (True, False)
                for reuse in order:
                    row = _fit(design, reuse, args.trials, args.steps)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        ray.shutdown()
    report = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_before": load_before,
            "load_after": os.getloadavg(),
        },
        "versions": {"ray": ray.__version__, "torch": torch.__version__},
        "command": f"python experiments/tune_reuse_actors.py --trials {args.trials} "
        f"--steps {args.steps} --rounds {args.rounds}",
        "rows": rows,
    }
    (args.out / "tune_reuse_actors.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'design':<12}{'reuse_actors':>14}{'wall_s':>9}{'cpu_s':>8}{'procs':>7}{'errors':>8}")
    for row in rows:
        print(
            f"{row['design']:<12}{row['reuse_actors']!s:>14}{row['wall_s']:>9}"
            f"{row['cpu_s']:>8}{row['processes']:>7}{row['errors']:>8}"
        )


if __name__ == "__main__":
    main()
