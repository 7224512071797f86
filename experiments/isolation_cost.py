"""What process isolation costs on this machine: start-up, dispatch rate, memory per worker.

Trivial trials (``x**2`` of one suggested float, in-memory storage) run by

* ``threads``: ``WaterwaveExecutor(devices="cpu", trials_per_device=K)`` (the default, slot threads
  in the driver's process),
* ``process``: ``WaterwaveExecutor(..., isolation="process")`` (a worker process per slot,
  spawned, reused across trials, its storage calls over a pipe to the driver),
* ``optuna``: Optuna's own ``study.optimize(objective, n_jobs=K)`` (threads, no executor),

for K = 1 and 4. Per configuration and repeat:

* ``first_trial_s``: seconds from the ``optimize`` call to the first objective's start (what a
  user waits before anything runs; for processes: spawning the workers, importing torch and the
  library in them, opening the study through the relay);
* ``worker_start_s``: per worker (a distinct pid for processes, the one driver for threads),
  seconds from the ``optimize`` call to its first trial's start; the median is reported;
* ``trials_per_s``: trials finished per second over the whole call (start-up included) and,
  ``steady_trials_per_s``, from the first trial's start to the last trial's end (dispatch only);
* ``worker_rss_bytes`` / ``worker_uss_bytes``: resident and unique memory of the process that
  ran a trial, read in the trial (psutil if installed, else ``/proc/self/status`` VmRSS; USS
  needs psutil); for threads that is the driver itself, shared by every slot.

With ``--ray``: the same trivial trials through ``RayExecutor`` on a local Ray (one logical GPU,
2 CPUs), ``isolation="threads"`` vs ``"process"`` at K=4 (``ray_*`` rows), and the time a
crashed host process takes to be replaced: trial 3 segfaults, ``respawn_s`` is the time from its
end to the next trial's start on a new actor.

Run: ``python experiments/isolation_cost.py --out experiments/results/<date>-isolation-cost/``.
Writes ``isolation_cost.csv`` (one row per configuration and repeat) and ``isolation_cost.json``
(machine, load average, versions, medians). Keep it short on a shared machine; record the load.
"""

from __future__ import annotations

import argparse
import csv
import inspect
import json
import os
from pathlib import Path
import platform
import statistics
import time
from typing import Any

import optuna

import waterwave_hpo as ww


def _memory() -> tuple[int, int | None]:
    """``(rss_bytes, uss_bytes)`` of this process (USS: ``None`` without psutil)."""
    try:
        import psutil
    except ImportError:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024, None
        return 0, None
    info = psutil.Process().memory_full_info()
    return int(info.rss), int(info.uss)


def trivial(trial: optuna.trial.Trial) -> float:
    """A trivial trial that records where it ran and that process's memory (first trial only)."""
    started = time.time()
    x = trial.suggest_float("x", -1.0, 1.0)
    trial.set_user_attr("pid", os.getpid())
    trial.set_user_attr("t", started)
    if trial.number < 16:  # psutil's USS walks the process's mappings: not on every trial
        rss, uss = _memory()
        trial.set_user_attr("rss", rss)
        trial.set_user_attr("uss", uss)
    return x * x


def process_supported() -> bool:
    """Whether this checkout's executor has ``isolation=``."""
    return "isolation" in inspect.signature(ww.WaterwaveExecutor.__init__).parameters


def run_one(method: str, k: int, n_trials: int) -> dict[str, Any]:
    """Run ``n_trials`` trivial trials with ``method`` at ``k`` slots; return the row."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study()
    t0 = time.time()
    if method == "optuna":
        study.optimize(trivial, n_trials=n_trials, n_jobs=k)
    else:
        kwargs: dict[str, Any] = {"devices": "cpu", "trials_per_device": k}
        if method == "process":
            kwargs["isolation"] = "process"
        ww.WaterwaveExecutor(**kwargs).optimize(study, trivial, n_trials=n_trials)
    total_s = time.time() - t0
    trials = study.get_trials(deepcopy=False)
    assert all(t.state is optuna.trial.TrialState.COMPLETE for t in trials), method
    # When each objective started, by its own clock: a trial's datetime_start is set when the
    # driver asks it, before a worker process exists to run it.
    starts = [float(t.user_attrs["t"]) for t in trials]
    ends = [t.datetime_complete.timestamp() for t in trials if t.datetime_complete]
    first_by_pid: dict[int, float] = {}
    for t in trials:
        pid = int(t.user_attrs["pid"])
        first_by_pid[pid] = min(first_by_pid.get(pid, 1e300), float(t.user_attrs["t"]) - t0)
    rss = [int(t.user_attrs["rss"]) for t in trials if "rss" in t.user_attrs]
    uss = [int(t.user_attrs["uss"]) for t in trials if t.user_attrs.get("uss") is not None]
    driver_rss, driver_uss = _memory()
    return {
        "method": method,
        "k": k,
        "n_trials": len(trials),
        "total_s": round(total_s, 3),
        "first_trial_s": round(min(starts) - t0, 3),
        "workers": len(first_by_pid),
        "worker_start_s": round(statistics.median(first_by_pid.values()), 3),
        "trials_per_s": round(len(trials) / total_s, 1),
        "steady_trials_per_s": round(len(trials) / max(1e-9, max(ends) - min(starts)), 1),
        "worker_rss_bytes": int(statistics.median(rss)) if rss else None,
        "worker_uss_bytes": int(statistics.median(uss)) if uss else None,
        "driver_rss_bytes": driver_rss,
        "driver_uss_bytes": driver_uss,
        "loadavg_1m": os.getloadavg()[0],
    }


def _pids_before(trials: list[optuna.trial.FrozenTrial], when_s: float) -> set[int]:
    return {int(t.user_attrs["pid"]) for t in trials if t.user_attrs.get("t", 1e300) <= when_s}


def crash_at_3(trial: optuna.trial.Trial) -> float:
    """Trial 3 segfaults its process once every first host process has run a trial.

    (The study starts on the first host up; waiting for the others makes every process that
    starts a trial after the crash a replacement.) The others sleep 50 ms; a later trial in a
    process that was there before the crash holds its slot until a replacement has run a
    trial, so the replacement's first trial is measured however long it takes to start.
    """
    import ctypes

    trial.set_user_attr("pid", os.getpid())
    trial.set_user_attr("t", time.time())
    time.sleep(0.05)
    study = trial.study
    deadline = time.monotonic() + 120
    if trial.number == 3:
        k = int(study.user_attrs["k"])
        while time.monotonic() < deadline:
            if len(_pids_before(study.get_trials(deepcopy=False), time.time())) >= k:
                break
            time.sleep(0.05)
        trial.set_user_attr("crash_s", time.time())
        ctypes.string_at(0)
    while trial.number > 3 and time.monotonic() < deadline:
        trials = study.get_trials(deepcopy=False)
        crash_s = trials[3].user_attrs.get("crash_s")
        if crash_s is None:
            break
        old = _pids_before(trials, float(crash_s))
        if os.getpid() not in old or _pids_before(trials, time.time()) - old:
            break
        time.sleep(0.05)
    return 0.0


def run_ray(isolation: str, k: int, n_trials: int) -> dict[str, Any]:
    """Trivial trials through ``RayExecutor(isolation=...)``; one ``ray_<isolation>`` row."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study()
    executor = ww.RayExecutor(n_hosts=1, trials_per_device=k, isolation=isolation)
    t0 = time.time()
    executor.optimize(study, trivial, n_trials=n_trials)
    total_s = time.time() - t0
    trials = study.get_trials(deepcopy=False)
    starts = [float(t.user_attrs["t"]) for t in trials]
    ends = [t.datetime_complete.timestamp() for t in trials if t.datetime_complete]
    rss = [int(t.user_attrs["rss"]) for t in trials if "rss" in t.user_attrs]
    uss = [int(t.user_attrs["uss"]) for t in trials if t.user_attrs.get("uss") is not None]
    return {
        "method": f"ray_{isolation}",
        "k": k,
        "n_trials": len(trials),
        "total_s": round(total_s, 3),
        "first_trial_s": round(min(starts) - t0, 3),
        "workers": len({t.user_attrs["pid"] for t in trials}),
        "worker_start_s": None,
        "trials_per_s": round(len(trials) / total_s, 1),
        "steady_trials_per_s": round(len(trials) / max(1e-9, max(ends) - min(starts)), 1),
        "worker_rss_bytes": int(statistics.median(rss)) if rss else None,
        "worker_uss_bytes": int(statistics.median(uss)) if uss else None,
        "driver_rss_bytes": None,
        "driver_uss_bytes": None,
        "loadavg_1m": os.getloadavg()[0],
    }


def ray_respawn_s(k: int, n_trials: int) -> float:
    """Seconds from the crashed trial's end to the next trial's start in a new host process."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study()
    study.set_user_attr("k", k)
    executor = ww.RayExecutor(n_hosts=1, trials_per_device=k, isolation="process")
    executor.optimize(study, crash_at_3, n_trials=n_trials)
    trials = study.get_trials(deepcopy=False)
    crashed = trials[3]
    assert crashed.state is optuna.trial.TrialState.FAIL
    crash_s = float(crashed.user_attrs["crash_s"])
    old = _pids_before(trials, crash_s)
    new = [float(t.user_attrs["t"]) for t in trials if int(t.user_attrs["pid"]) not in old]
    if not new:
        raise RuntimeError(
            "no trial ran in a new host process: "
            + repr([(t.number, t.state.name, t.user_attrs, t.system_attrs) for t in trials])
        )
    return round(min(new) - crash_s, 3)


def main_ray(args: argparse.Namespace) -> None:
    """The ``--ray`` rows: dispatch per isolation and the replacement time of a crashed host."""
    import ray

    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(__import__(__name__))
    rows = []
    respawns = []
    for repeat in range(args.repeats):
        for isolation in ("threads", "process"):
            row = {"repeat": repeat, **run_ray(isolation, 4, args.n_trials)}
            print(json.dumps(row), flush=True)
            rows.append(row)
        respawns.append(ray_respawn_s(2, 16))
        print(json.dumps({"respawn_s": respawns[-1]}), flush=True)
    ray.shutdown()
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "isolation_cost_ray.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    summary = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only, 1 logical Ray GPU",
        "ray": ray.__version__,
        "loadavg_at_end": os.getloadavg(),
        "respawn_s": respawns,
        "medians": {
            f"{m}-K4": {
                key: statistics.median(r[key] for r in rows if r["method"] == m)
                for key in ("first_trial_s", "trials_per_s", "steady_trials_per_s")
            }
            for m in ("ray_threads", "ray_process")
        },
    }
    (args.out / "isolation_cost_ray.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


def main() -> None:
    """Run every configuration ``--repeats`` times, interleaved; write the CSV and the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--n-trials", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default="threads,process,optuna")
    parser.add_argument("--ray", action="store_true", help="the RayExecutor rows instead")
    args = parser.parse_args()
    if args.ray:
        main_ray(args)
        return
    methods = [m for m in args.methods.split(",") if m != "process" or process_supported()]
    rows = []
    for repeat in range(args.repeats):
        for method in methods:
            for k in (1, 4):
                row = {"repeat": repeat, **run_one(method, k, args.n_trials)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "isolation_cost.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    medians = {}
    for method in methods:
        for k in (1, 4):
            mine = [r for r in rows if r["method"] == method and r["k"] == k]
            medians[f"{method}-K{k}"] = {
                key: statistics.median(r[key] for r in mine)
                for key in (
                    "first_trial_s",
                    "worker_start_s",
                    "trials_per_s",
                    "steady_trials_per_s",
                    "worker_rss_bytes",
                    "worker_uss_bytes",
                )
                if all(r[key] is not None for r in mine)
            }
    import torch

    try:
        import psutil

        psutil_version: str | None = psutil.__version__
    except ImportError:
        psutil_version = None
    summary = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only",
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "optuna": optuna.__version__,
        "waterwave_hpo": ww.__version__,
        "psutil": psutil_version,
        "loadavg_at_end": os.getloadavg(),
        "n_trials": args.n_trials,
        "repeats": args.repeats,
        "medians": medians,
    }
    (args.out / "isolation_cost.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
