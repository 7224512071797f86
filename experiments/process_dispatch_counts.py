"""What a trivial trial costs on a worker's pipe (``isolation="process"``), counted, not timed.

Runs ``--trials`` trivial trials (one ``set_user_attr``, one ``suggest_float``: the objective of
``process_speed.py``) on warm workers (K=``--k``, in-memory storage, ``RandomSampler``) and
prints, per trial, the messages that crossed the pipes by kind (both ways; the posted writes
inside a batch count as ``from:post``), the messages as sent (``sent``, ``received``: a batch
once) and the calls the worker waited on (``from:call``), from the driver's counters
(``WorkerProcess.counts``); then the CPU seconds per trial of the driver and of the workers
(``/proc``), beside the threads' (one process) for the same trials; and the sampler's reseeds
per trial in the driver and in the workers (``RandomSampler.reseed_rng``: 0.1-0.4 ms each
with NumPy's ``RandomState``). Run:
``python experiments/process_dispatch_counts.py --out DIR`` (writes ``counts.json``).
"""

from __future__ import annotations

import argparse
from collections import Counter
import json
import os
from pathlib import Path
import time

import optuna

import waterwave_hpo as ww


def trivial(trial: optuna.trial.Trial) -> float:
    """The trivial trial of ``process_speed.py``."""
    trial.set_user_attr("t", time.time())
    x = trial.suggest_float("x", -1.0, 1.0)
    return x * x


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CountingSampler(optuna.samplers.RandomSampler):
    """``RandomSampler`` counting its ``reseed_rng`` calls, per process (a class attribute)."""

    reseeds = 0

    def reseed_rng(self) -> None:
        type(self).reseeds += 1
        super().reseed_rng()


def counted(trial: optuna.trial.Trial) -> float:
    """The trivial trial, recording its process and the reseeds its sampler has seen there."""
    trial.set_user_attr("t", (os.getpid(), type(trial.study.sampler).reseeds))
    x = trial.suggest_float("x", -1.0, 1.0)
    return x * x


def _study() -> optuna.Study:
    return optuna.create_study(sampler=CountingSampler(seed=0))


def _worker_reseeds(study: optuna.Study) -> int:
    """Reseeds in the workers during ``study``'s run, on new workers: each one's last count."""
    seen: dict[int, list[int]] = {}
    for trial in study.get_trials(deepcopy=False):
        pid, count = trial.user_attrs["t"]
        seen.setdefault(pid, []).append(count)
    return sum(max(counts) for counts in seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    n = args.trials
    me = os.getpid()
    with ww.WaterwaveExecutor("cpu", args.k, isolation="process") as executor:
        executor.optimize(_study(), trivial, n_trials=args.k)  # the workers are warm
        workers = [w for pool in executor._workers.pools.values() for w in pool.workers]  # type: ignore[union-attr]
        for worker in workers:
            worker.counts.clear()
        pids = [w.pid for w in workers]
        before = {pid: _cpu_s(pid) for pid in [*pids, me]}
        start = time.time()
        executor.optimize(_study(), trivial, n_trials=n)
        process_s = time.time() - start
        after = {pid: _cpu_s(pid) for pid in [*pids, me]}
        counts: Counter[str] = Counter()
        for worker in workers:
            counts.update(worker.counts)
    # Reseeds: a run of its own on new workers (each process counts from 0), its objective
    # recording its process and that process's count.
    CountingSampler.reseeds = 0
    reseeded = _study()
    n_counted = args.k * 10
    with ww.WaterwaveExecutor("cpu", args.k, isolation="process") as executor:
        executor.optimize(reseeded, counted, n_trials=n_counted)
    driver_reseeds = CountingSampler.reseeds
    worker_reseeds = _worker_reseeds(reseeded)
    threads = ww.WaterwaveExecutor("cpu", args.k)
    cpu_start = _cpu_s(me)
    start = time.time()
    threads.optimize(_study(), trivial, n_trials=n)
    threads_s = time.time() - start
    result = {
        "k": args.k,
        "trials": n,
        "load": os.getloadavg(),
        "per_trial": {kind: counts[kind] / n for kind in sorted(counts)},
        "cpu_us_per_trial": {
            "process_driver": 1e6 * (after[me] - before[me]) / n,
            "process_workers": 1e6 * sum(after[p] - before[p] for p in pids) / n,
            "threads": 1e6 * (_cpu_s(me) - cpu_start) / n,
        },
        "trials_per_s": {"process": n / process_s, "threads": n / threads_s},
        "reseeds_per_trial": {
            "process_driver": driver_reseeds / n_counted,
            "process_workers": worker_reseeds / n_counted,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "counts.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
