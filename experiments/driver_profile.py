"""Where the driver's CPU goes per trial with ``RayExecutor``.

Runs one ``optimize`` of trivial trials (as ``experiments/driver_cost.py``) and reports, per
trial: the storage calls the hosts relayed to the driver (by method, counted in the driver's
``StorageService``), the Ray actor calls the driver made (by method), and the driver's CPU time
by thread (``/proc/self/task/<tid>/stat``: the executor's loop, the storage relay's thread and
its workers, the pollers, Ray's own C++ threads). With ``--cprofile`` the relay's and the
pollers' Python threads and the main thread run under ``cProfile``; the top functions by
cumulative time are printed.

Run: ``python experiments/driver_profile.py --hosts 4 --n-trials 200 [--storage sqlite]``.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import os
from pathlib import Path
import pstats
import tempfile
import threading
import time
from typing import Any

import optuna

import waterwave_hpo as ww

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _trivial(trial: optuna.trial.Trial) -> float:
    return trial.suggest_float("x", -1.0, 1.0) ** 2


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process, summed by thread name."""
    by_name: dict[str, float] = collections.defaultdict(float)
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        by_name[_family(name)] += (int(fields[11]) + int(fields[12])) * _TICK_S
    return dict(by_name)


def _family(name: str) -> str:
    # Threads of one kind (waterwave-ray-<host>, ww-storage_N) summed together.
    for prefix in ("waterwave-ray", "ww-storage", "waterwave-storage"):
        if name.startswith(prefix):
            return prefix
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--n-trials", type=int, default=200)
    parser.add_argument("--trials-per-device", type=int, default=2)
    parser.add_argument("--storage", choices=["memory", "sqlite"], default="memory")
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--trial-s", type=float, default=0.0, help="each trial sleeps this long")
    parser.add_argument("--gather-ms", type=float, default=None, help="the relay's gather time")
    args = parser.parse_args()
    if args.gather_ms is not None:
        from waterwave_hpo.cluster._storage import StorageServer

        StorageServer.__init__.__defaults__ = (16, args.gather_ms / 1000)
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    import ray
    from ray.actor import ActorMethod

    from waterwave_hpo.relay import StorageService

    relayed: collections.Counter[str] = collections.Counter()
    actor_calls: collections.Counter[str] = collections.Counter()
    run = StorageService.run

    def counted_run(self: Any, method: str, call_args: tuple[Any, ...]) -> Any:
        relayed[method] += 1
        if method == "set_trial_system_attr":
            relayed[f"  {call_args[1]}"] += 1
        return run(self, method, call_args)

    StorageService.run = counted_run  # type: ignore[method-assign]
    remote = ActorMethod.remote

    def counted_remote(self: Any, *a: Any, **k: Any) -> Any:
        actor_calls[self._method_name] += 1
        return remote(self, *a, **k)

    ActorMethod.remote = counted_remote  # type: ignore[method-assign]

    profiles: list[cProfile.Profile] = []
    main_profile: cProfile.Profile | None = None
    python_threads: dict[str, float] = collections.defaultdict(float)
    original_run = threading.Thread.run

    def measured_run(self: threading.Thread) -> None:
        # Python threads are all "python" in /proc: their CPU is taken here, at their end.
        profile = cProfile.Profile(time.thread_time) if args.cprofile else None
        if profile is not None:
            profiles.append(profile)
            profile.enable()
        cpu0 = time.thread_time()
        try:
            original_run(self)
        finally:
            python_threads[_family(self.name)] += time.thread_time() - cpu0
            if profile is not None:
                profile.disable()

    threading.Thread.run = measured_run  # type: ignore[method-assign]

    ray.init(
        address="local",
        num_cpus=2,
        num_gpus=args.hosts,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            storage = None if args.storage == "memory" else f"sqlite:///{tmp}/study.db"
            study = optuna.create_study(storage=storage)
            executor = ww.RayExecutor(
                n_hosts=args.hosts,
                trials_per_device=args.trials_per_device,
                num_cpus_per_host=0.25,
            )
            load = os.getloadavg()
            main_profile: cProfile.Profile | None = (
                cProfile.Profile(time.thread_time) if args.cprofile else None
            )
            cpu0, wall0, threads0 = time.process_time(), time.perf_counter(), thread_cpu()
            if main_profile is not None:
                main_profile.enable()
            main0 = time.thread_time()
            trial_s = args.trial_s

            def objective(trial: optuna.trial.Trial) -> float:
                time.sleep(trial_s)
                return _trivial(trial)

            executor.optimize(study, objective, n_trials=args.n_trials)
            python_threads["main (executor loop)"] += time.thread_time() - main0
            if main_profile is not None:
                main_profile.disable()
                profiles.append(main_profile)
            threads1 = thread_cpu()
            cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
            trials = study.trials
    finally:
        ray.shutdown()
    time.sleep(0.5)  # the relay's worker threads end after optimize
    n = len(trials)
    starts = sorted(t.datetime_start.timestamp() for t in trials if t.datetime_start)
    ends = sorted(t.datetime_complete.timestamp() for t in trials if t.datetime_complete)
    per_thread = {
        name: round(1000 * (threads1.get(name, 0.0) - threads0.get(name, 0.0)) / n, 2)
        for name in threads1
        if name != "python"
    }
    result = {
        "hosts": args.hosts,
        "storage": args.storage,
        "n_trials": n,
        "loadavg_before": load,
        "optimize_wall_s": round(wall_s, 2),
        "trials_per_s": round(n / (ends[-1] - starts[0]), 1),
        "driver_cpu_ms_per_trial": round(1000 * cpu_s / n, 2),
        "relayed_calls_per_trial": {m: round(c / n, 2) for m, c in relayed.most_common()},
        "actor_calls_per_trial": {m: round(c / n, 2) for m, c in actor_calls.most_common()},
        "python_thread_cpu_ms_per_trial": {
            name: round(1000 * cpu / n, 2) for name, cpu in python_threads.items()
        },
        "native_thread_cpu_ms_per_trial": dict(
            sorted(per_thread.items(), key=lambda item: -item[1])[:12]
        ),
    }
    print(json.dumps(result, indent=1))
    if main_profile is not None:
        stream = io.StringIO()
        pstats.Stats(main_profile, stream=stream).sort_stats("cumtime").print_stats(45)
        print("== the main thread (the executor's loop), CPU time ==")
        print(stream.getvalue())
    if profiles:
        print("== every profiled thread, CPU time ==")
        stream = io.StringIO()
        stats = pstats.Stats(profiles[0], stream=stream)
        for profile in profiles[1:]:
            stats.add(profile)
        stats.sort_stats("tottime").print_stats(35)
        stats.sort_stats("cumtime").print_stats("optuna/(storages|study|trial)|waterwave_hpo", 40)
        print(stream.getvalue())


if __name__ == "__main__":
    main()
