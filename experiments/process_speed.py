"""Process isolation with warm workers against threads and Optuna's ``n_jobs``, on this machine.

Three measurements, each for ``threads`` (``WaterwaveExecutor(devices="cpu",
trials_per_device=K)``), ``process`` (the same with ``isolation="process"``: warm worker
processes) and ``optuna`` (``study.optimize(objective, n_jobs=K)``), in one run:

* ``first_trial_s``: seconds from ``optimize`` to the first objective's start. For processes
  twice: ``process_cold`` (a new executor: the workers start, import torch and the library) and
  ``process`` (the executor's second study: its workers are warm).
* ``trials_per_s``: ``--trivial`` trivial trials (``x**2`` of one suggested float, in-memory
  storage, the default TPE sampler replaced by ``RandomSampler`` so the sampler's cost does not
  hide the dispatch's), finished per second over the whole call; processes on warm workers.
* ``study_s``: a short-trial study: ``--short`` trials, each 40 SGD steps of a small MLP on
  random data, wall seconds.

Ratios are computed from the same run (``process`` over ``threads``). Run:
``python experiments/process_speed.py --out experiments/results/<date>-process-speed/``.
Writes ``process_speed.json`` (machine, load average before and after, versions, rows).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import platform
import time
from typing import Any

import optuna
import torch

import waterwave_hpo as ww


def trivial(trial: optuna.trial.Trial) -> float:
    """A trivial trial; records when it started."""
    trial.set_user_attr("t", time.time())
    x = trial.suggest_float("x", -1.0, 1.0)
    return x * x


def short(trial: optuna.trial.Trial) -> float:
    """A short training trial: 40 SGD steps of a small MLP (a few tens of ms on a CPU core)."""
    trial.set_user_attr("t", time.time())
    lr = trial.suggest_float("lr", 1e-3, 1e-1, log=True)
    torch.manual_seed(trial.number)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = torch.randn(256, 32), torch.randn(256, 1)
    loss = torch.zeros(())
    for _ in range(40):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return float(loss.item())


def _study() -> optuna.Study:
    return optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))


def _run(runner: Any, func: Any, n_trials: int) -> dict[str, float]:
    study = _study()
    start = time.time()
    runner(study, func, n_trials)
    wall_s = time.time() - start
    first = min(t.user_attrs["t"] for t in study.trials)
    states = {t.state.name for t in study.trials}
    assert states == {"COMPLETE"}, states
    return {
        "first_trial_s": first - start,
        "wall_s": wall_s,
        "trials_per_s": n_trials / wall_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--trivial", type=int, default=1000)
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    k = args.k
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    threads = ww.WaterwaveExecutor("cpu", k)

    def optuna_jobs(study: optuna.Study, func: Any, n: int) -> None:
        study.optimize(func, n_trials=n, n_jobs=k)

    for repeat in range(args.repeats):
        cold_start = time.time()
        with ww.WaterwaveExecutor("cpu", k, isolation="process") as process:
            cold = _run(process.optimize, trivial, k)
            rows.append({"config": "process_cold", "bench": "first", "repeat": repeat, **cold})
            for bench, func, n in (
                ("first", trivial, k),
                ("trivial", trivial, args.trivial),
                ("short", short, args.short),
            ):
                for name, runner in (
                    ("threads", threads.optimize),
                    ("process", process.optimize),
                    ("optuna", optuna_jobs),
                ):
                    row = _run(runner, func, n)
                    rows.append({"config": name, "bench": bench, "repeat": repeat, **row})
                    print(name, bench, repeat, {key: round(v, 4) for key, v in row.items()})
        print("process executor lifetime", round(time.time() - cold_start, 2), "s")
    summary: dict[str, Any] = {}
    for bench in ("first", "trivial", "short"):
        for name in ("threads", "process", "optuna", "process_cold"):
            picked = [r for r in rows if r["config"] == name and r["bench"] == bench]
            if picked:
                summary[f"{bench}/{name}"] = {
                    key: sorted(r[key] for r in picked)[len(picked) // 2]
                    for key in ("first_trial_s", "wall_s", "trials_per_s")
                }
    ratios = {}
    for bench in ("trivial", "short"):
        per_repeat = [
            next(
                r
                for r in rows
                if r["config"] == "process" and r["bench"] == bench and r["repeat"] == i
            )["trials_per_s"]
            / next(
                r
                for r in rows
                if r["config"] == "threads" and r["bench"] == bench and r["repeat"] == i
            )["trials_per_s"]
            for i in range(args.repeats)
        ]
        ratios[f"{bench}: process rate / threads rate, per repeat"] = per_repeat
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "optuna": optuna.__version__,
            "load_before": load_before,
            "load_after": os.getloadavg(),
        },
        "k": k,
        "rows": rows,
        "medians": summary,
        "ratios": ratios,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "process_speed.json").write_text(json.dumps(result, indent=2))
    print(
        json.dumps(
            {"medians": summary, "ratios": ratios, "load": [load_before, os.getloadavg()]}, indent=2
        )
    )


if __name__ == "__main__":
    main()
