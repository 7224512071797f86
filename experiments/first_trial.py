"""Time from ``RayExecutor.optimize`` to the first trial, and to the first trial on a late host.

Two scenarios on this machine (CPU only; Ray's GPUs are logical):

* ``unplaceable``: ``ray.init(num_cpus=2, num_gpus=4)`` and ``RayExecutor(trials_per_device=4)``
  start one host per GPU, each reserving one CPU: two hosts can be placed, two never can. The
  study must start on the hosts that are up, not wait ``startup_timeout_s`` for the others.
* ``late``: a ``ray.cluster_utils.Cluster`` whose head has one GPU; a node with one more GPU is
  added a few seconds into the study; its host joins and runs trials.

Run: ``python experiments/first_trial.py --out experiments/results/<date>-first-trial/``.
Writes ``first_trial.json`` with the machine and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import platform
import threading
import time

import optuna

import waterwave_hpo as ww


def _trivial(trial: optuna.trial.Trial) -> float:
    return trial.suggest_float("x", -1.0, 1.0) ** 2


def _short(trial: optuna.trial.Trial) -> float:
    time.sleep(0.2)
    return trial.suggest_float("x", -1.0, 1.0) ** 2


def _first_starts(study: optuna.Study, t0: float) -> dict[str, float]:
    """Seconds from ``t0`` (wall clock) to the first trial start on each host."""
    firsts: dict[str, float] = {}
    for t in study.get_trials(deepcopy=False):
        host = str(t.system_attrs.get(ww.cluster.ATTR_HOST, "?"))
        assert t.datetime_start is not None
        start = t.datetime_start.timestamp() - t0
        firsts[host] = min(firsts.get(host, start), start)
    return dict(sorted(firsts.items(), key=lambda kv: kv[1]))


def unplaceable(n_trials: int) -> dict[str, object]:
    import ray

    ray.init(address="local", num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False)
    try:
        study = optuna.create_study()
        executor = ww.RayExecutor(trials_per_device=4)
        t0 = time.time()
        executor.optimize(study, _trivial, n_trials=n_trials)
        total_s = time.time() - t0
        firsts = _first_starts(study, t0)
        states = {s.name: 0 for s in optuna.trial.TrialState}
        for t in study.trials:
            states[t.state.name] += 1
        return {
            "ray": "ray.init(num_cpus=2, num_gpus=4)",
            "executor": "RayExecutor(trials_per_device=4), startup_timeout_s=120 (default)",
            "n_trials": n_trials,
            "total_s": round(total_s, 2),
            "trials_per_s": round(n_trials / total_s, 1),
            "first_trial_s": round(min(firsts.values()), 2),
            "first_trial_per_host_s": {k: round(v, 2) for k, v in firsts.items()},
            "states": {k: v for k, v in states.items() if v},
        }
    finally:
        ray.shutdown()


def late(n_trials: int, join_after_s: float) -> dict[str, object]:
    import ray
    from ray import cluster_utils

    cluster = cluster_utils.Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "num_gpus": 1, "include_dashboard": False},
    )
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        study = optuna.create_study()
        executor = ww.RayExecutor(trials_per_device=2)
        added: dict[str, float] = {}
        done: dict[str, float] = {}

        def run() -> None:
            executor.optimize(study, _short, n_trials=n_trials)
            done["t"] = time.time()

        # Ray adds a node only from the main thread (it installs signal handlers): the study
        # runs in a thread meanwhile.
        runner = threading.Thread(target=run, daemon=True)
        t0 = time.time()
        runner.start()
        time.sleep(join_after_s)
        cluster.add_node(num_cpus=1, num_gpus=1)
        added["t"] = time.time()
        runner.join()
        total_s = done["t"] - t0
        firsts = _first_starts(study, t0)
        starts = list(firsts.values())
        return {
            "ray": "cluster_utils.Cluster: head 2 CPUs + 1 GPU; a node of 1 CPU + 1 GPU added",
            "executor": "RayExecutor(trials_per_device=2); objective sleeps 0.2 s",
            "n_trials": n_trials,
            "total_s": round(total_s, 2),
            "node_added_s": round(added["t"] - t0, 2) if added else None,
            "first_trial_s": round(starts[0], 2),
            "first_trial_on_late_host_s": round(starts[1], 2) if len(starts) > 1 else None,
            "late_host_after_node_added_s": (
                round(starts[1] - (added["t"] - t0), 2) if len(starts) > 1 and added else None
            ),
            "first_trial_per_host_s": {k: round(v, 2) for k, v in firsts.items()},
        }
    finally:
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--n-trials", type=int, default=100)
    parser.add_argument("--join-after-s", type=float, default=4.0)
    parser.add_argument("--late-trials", type=int, default=120)
    parser.add_argument("--only", choices=("unplaceable", "late"), default=None)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, object] = {
        "machine": f"2-core {platform.machine()} VM, CPU only, torch "
        + __import__("torch").__version__,
        "loadavg_before": os.getloadavg(),
    }
    if args.only in (None, "unplaceable"):
        result["unplaceable"] = unplaceable(args.n_trials)
    if args.only in (None, "late"):
        result["late"] = late(args.late_trials, args.join_after_s)
    result["loadavg_after"] = os.getloadavg()
    name = "first_trial.json" if args.only is None else f"first_trial_{args.only}.json"
    (args.out / name).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
