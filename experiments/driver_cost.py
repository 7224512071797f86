"""Driver CPU per trial and trials/s of ``RayExecutor`` with 1, 4 and 8 hosts.

Trivial trials (one ``suggest_float``), an in-memory study on the driver, a local Ray with as many
logical GPUs as hosts and CPU hosts reserving a quarter CPU each, so that 8 hosts fit on this
2-core machine. Driver CPU is ``time.process_time()`` of the driver process (every thread of it:
the executor's loop, the storage relay that answers the hosts, the pollers, Ray's own client
threads), two ways: over the whole ``optimize`` divided by the trials run (start-up included:
Ray's serialization set-up, the actors' creation), and in the steady state, between the end of
the ``--warmup``-th trial and the last one (read from a thread that samples it every 20 ms, at
the times the driver told those trials), divided by the trials told in between: what each
further trial costs.

``--storage sqlite`` puts the study in a SQLite file on the driver (Optuna's RDB storage).

Run: ``python experiments/driver_cost.py --out experiments/results/<date>-driver-cost/``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import platform
import tempfile
import threading
import time

import optuna

import waterwave_hpo as ww


def _trivial(trial: optuna.trial.Trial) -> float:
    return trial.suggest_float("x", -1.0, 1.0) ** 2


class _Sleeping:
    """A trivial trial that lasts ``trial_s`` seconds (sleeping: the hosts stay idle)."""

    def __init__(self, trial_s: float) -> None:
        self.trial_s = trial_s

    def __call__(self, trial: optuna.trial.Trial) -> float:
        time.sleep(self.trial_s)
        return _trivial(trial)


def _cpu_at(samples: list[tuple[float, float]], when: float) -> float:
    """The driver's CPU time at wall-clock ``when``, from the first sample at or after it."""
    return next((cpu for t, cpu in samples if t >= when), samples[-1][1])


def measure(
    n_hosts: int,
    n_trials: int,
    trials_per_device: int,
    storage: str,
    warmup: int,
    trial_s: float = 0.0,
) -> dict[str, object]:
    import ray

    ray.init(
        address="local",
        num_cpus=2,
        num_gpus=n_hosts,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        executor = ww.RayExecutor(
            n_hosts=n_hosts, trials_per_device=trials_per_device, num_cpus_per_host=0.25
        )
        # Driver CPU over the whole call (host start-up included: the driver mostly waits
        # then); trials/s from the first trial's start to the last one's end.
        tmp = tempfile.TemporaryDirectory()
        url = None if storage == "memory" else f"sqlite:///{tmp.name}/study.db"
        study = optuna.create_study(storage=url)
        # (wall clock, driver CPU) every 20 ms: the CPU spent between two trials' ends, read
        # at the times the driver told them (a callback could be held up behind the loop).
        samples: list[tuple[float, float]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.02):
                samples.append((time.time(), time.process_time()))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        objective = _Sleeping(trial_s) if trial_s > 0 else _trivial
        executor.optimize(study, objective, n_trials=n_trials)
        cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
        stop.set()
        sampler.join()
        told = sorted(t.datetime_complete.timestamp() for t in study.trials)
        steady_ms = 1000 * (_cpu_at(samples, told[-1]) - _cpu_at(samples, told[warmup - 1]))
        steady_ms /= len(told) - warmup
        starts = sorted(t.datetime_start.timestamp() for t in study.trials if t.datetime_start)
        ends = sorted(t.datetime_complete.timestamp() for t in study.trials if t.datetime_complete)
        running_s = ends[-1] - starts[0]
        tmp.cleanup()
        return {
            "n_hosts": n_hosts,
            "storage": storage,
            "trial_s": trial_s,
            "trials_per_device": trials_per_device,
            "n_trials": len(study.trials),
            "optimize_wall_s": round(wall_s, 2),
            "first_to_last_trial_s": round(running_s, 2),
            "trials_per_s": round(len(study.trials) / running_s, 1),
            "driver_cpu_s": round(cpu_s, 2),
            "driver_cpu_ms_per_trial": round(1000 * cpu_s / len(study.trials), 1),
            "steady_driver_cpu_ms_per_trial": round(steady_ms, 2),
        }
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--n-trials", type=int, default=200)
    parser.add_argument("--hosts", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--trials-per-device", type=int, default=2)
    parser.add_argument("--storage", choices=["memory", "sqlite"], nargs="+", default=["memory"])
    parser.add_argument("--warmup", type=int, default=20, help="trials before the steady state")
    parser.add_argument("--trial-s", type=float, default=0.0, help="each trial sleeps this long")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for storage in args.storage:
        for n_hosts in args.hosts:
            load = os.getloadavg()
            run = measure(
                n_hosts, args.n_trials, args.trials_per_device, storage, args.warmup, args.trial_s
            )
            run["loadavg_before"] = [round(x, 2) for x in load]
            runs.append(run)
            print(json.dumps(run), flush=True)
    result = {
        "machine": f"2-core {platform.machine()} VM, CPU only, torch "
        + __import__("torch").__version__,
        "what": "RayExecutor, trivial trials, study on the driver, local Ray, logical GPUs",
        "versions": {
            "ray": __import__("ray").__version__,
            "optuna": optuna.__version__,
            "python": platform.python_version(),
        },
        "runs": runs,
    }
    name = "driver_cost.json" if args.trial_s == 0 else f"driver_cost_{args.trial_s:g}s.json"
    (args.out / name).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
