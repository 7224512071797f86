"""DataLoader workers started from a trial: threads vs worker processes, by start method.

A 2-epoch study whose objective trains a linear model on a ``TensorDataset`` through
``DataLoader(num_workers=2)`` (workers started anew each epoch, as by default), run by

* ``threads``: ``WaterwaveExecutor(devices="cpu", trials_per_device=K)``;
* ``process``: ``isolation="process"``, the DataLoader with the worker's default start method
  (the driver's, ``fork`` on Linux when the driver chose none);
* ``process-spawn``: the same with ``multiprocessing_context="spawn"`` (what a worker used
  before it took the driver's start method: each DataLoader worker starts an interpreter, imports
  torch and re-imports this script, every epoch).

Per configuration: ``wall_s`` (the ``optimize`` call, worker start-up included) and
``dataloader_s`` (median over trials of the seconds the objective spent in its two epochs, what
the start method decides). Run: ``python experiments/dataloader_in_workers.py --out DIR``;
writes ``dataloader_in_workers.json`` (machine, load average, rows).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import platform
import statistics
import sys
import time

import optuna
import torch
from torch.utils.data import DataLoader
from torch.utils.data import TensorDataset

import waterwave_hpo as ww

_CONTEXT = os.environ.get("WW_DATALOADER_CONTEXT") or None


def objective(trial: optuna.trial.Trial) -> float:
    lr = trial.suggest_float("lr", 1e-3, 1e-1, log=True)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss = torch.zeros(())
    start = time.perf_counter()
    for _epoch in range(2):
        loader = DataLoader(data, batch_size=64, num_workers=2, multiprocessing_context=_CONTEXT)
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
    trial.set_user_attr("dataloader_s", time.perf_counter() - start)
    return float(loss.detach())


def run(isolation: str, k: int, n_trials: int) -> dict[str, object]:
    study = optuna.create_study()
    executor = ww.WaterwaveExecutor(devices="cpu", trials_per_device=k, isolation=isolation)
    start = time.perf_counter()
    executor.optimize(study, objective, n_trials=n_trials)
    wall_s = time.perf_counter() - start
    seconds = [t.user_attrs["dataloader_s"] for t in study.trials if "dataloader_s" in t.user_attrs]
    return {
        "wall_s": round(wall_s, 2),
        "dataloader_s": round(statistics.median(seconds), 3) if seconds else None,
        "complete": sum(t.state.name == "COMPLETE" for t in study.trials),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--trials", type=int, default=4)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rows = []
    for name, isolation, context in (
        ("threads", "threads", ""),
        ("process", "process", ""),
        ("process-spawn", "process", "spawn"),
    ):
        # Read by the objective here and, through the environment, in the workers.
        os.environ["WW_DATALOADER_CONTEXT"] = context
        global _CONTEXT
        _CONTEXT = context or None
        row = {"config": name, "k": args.k, "trials": args.trials}
        row.update(run(isolation, args.k, args.trials))
        print(row, flush=True)
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dataloader_in_workers.json").write_text(
        json.dumps(
            {
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "load_average_at_end": os.getloadavg(),
                "python": sys.version.split()[0],
                "torch": torch.__version__,
                "optuna": optuna.__version__,
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
