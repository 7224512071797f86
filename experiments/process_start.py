"""Process isolation's start, memory and crash recovery: threads, zygote workers, spawned workers.

Side by side in one run, each mode in fresh Python processes (so a "new executor" is new to the
process, and nothing warm is left from another mode):

* ``threads``: ``WaterwaveExecutor(devices="cpu", trials_per_device=K)``;
* ``zygote``: the same with ``isolation="process"`` (workers forked by the executor's zygote);
* ``spawn``: the same with ``WATERWAVE_WORKER_START=spawn`` (each worker a fresh interpreter,
  as before the zygote).

Measured per mode (``--k`` slots, default 4):

* ``new_executor_s``: seconds from a new executor's construction to the end of ``optimize``
  with ``--trials`` (8) trivial trials, for the process's first executor and for a second new
  executor of the same process (the library's zygote template is warm then); the library is
  imported before the clock starts;
* ``memory``: each worker's private memory (``psutil``'s ``memory_full_info().uss``) and its
  proportional share of shared pages (``pss``) while K trials run (all K inside at once: trials
  that sleep, then trials that train a small MLP), the zygote's and its template's, and the sum
  of every process's PSS (driver included: what the machine holds for the run);
* ``trivial_per_s``: ``--rate`` trivial trials on the warm executor, per second;
* ``crash_gap_s``: after a trial kills its worker (SIGKILL, as the OOM killer or a native
  crash would), seconds until the slot's next trial starts (K=1, three crashes);
* ``thread_exit``: the trial states of a script whose ``optimize`` runs in a non-main thread
  while the main thread returns at once (every trial should be COMPLETE or FAIL).

Run: ``python experiments/process_start.py --out experiments/results/<date>-zygote/``. Writes
``process_start.json`` (machine, load average before and after, versions, every row) and prints
a table.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

MODES = ("threads", "zygote", "spawn")
_MIB = 1 << 20


def trivial(trial: Any) -> float:
    """A trivial trial; records when it started."""
    trial.set_user_attr("t", time.time())
    x = trial.suggest_float("x", -1.0, 1.0)
    return x * x


def sleeper(trial: Any) -> float:
    """A trial that stays inside for a while (K of them run at once)."""
    trial.set_user_attr("pid", os.getpid())
    x = trial.suggest_float("x", -1.0, 1.0)
    time.sleep(2.0)
    return x


def trainer(trial: Any) -> float:
    """A short training trial that stays inside for a while: SGD steps of a small MLP."""
    import torch

    lr = trial.suggest_float("lr", 1e-3, 1e-1, log=True)
    torch.manual_seed(trial.number)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = torch.randn(256, 32), torch.randn(256, 1)
    loss = torch.zeros(())
    end = time.time() + 2.0
    while time.time() < end:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return float(loss.item())


def crasher(trial: Any) -> float:
    """Even trials kill their worker (after noting when); odd ones note when they start."""
    trial.set_user_attr("t", time.time())
    if trial.number % 2 == 0:
        with open(os.environ["WW_CRASH_LOG"], "a") as log:
            log.write(f"{trial.number} {time.time()}\n")
        os.kill(os.getpid(), signal.SIGKILL)
    return 0.0


def _executor(mode: str, k: int) -> Any:
    import waterwave_hpo as ww

    if mode == "threads":
        return ww.WaterwaveExecutor("cpu", k)
    return ww.WaterwaveExecutor("cpu", k, isolation="process")


def _study() -> Any:
    import optuna

    return optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))


def _memory_mib(pid: int) -> tuple[float, float] | None:
    """``(uss, pss)`` of process ``pid`` in MiB, or ``None`` (it is gone)."""
    import psutil

    try:
        info = psutil.Process(pid).memory_full_info()
    except psutil.Error:
        return None
    return round(info.uss / _MIB, 1), round(info.pss / _MIB, 1)


def _process_tree() -> dict[str, list[int]]:
    """This process's worker, zygote and template pids (by their command lines)."""
    import psutil

    from waterwave_hpo.workers._zygote import WORKER_MARK
    from waterwave_hpo.workers._zygote import ZYGOTE_MARK

    found: dict[str, list[int]] = {"workers": [], "zygotes": []}
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = child.cmdline()
        except psutil.Error:
            continue
        if WORKER_MARK in cmdline:
            found["workers"].append(child.pid)
        elif ZYGOTE_MARK in cmdline:
            found["zygotes"].append(child.pid)
    return found


def child(mode: str, k: int, n_trials: int, rate: int) -> dict[str, Any]:
    """One mode's measurements, in this (fresh) process."""
    if mode == "spawn":
        os.environ["WATERWAVE_WORKER_START"] = "spawn"
    import optuna

    import waterwave_hpo  # noqa: F401  (imported before the clock starts, as a script would)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    row: dict[str, Any] = {"mode": mode, "k": k}
    new_executor_s = []
    first_trial_s = []
    executors = []
    for _ in range(2):  # the process's first new executor, then a second one
        start = time.time()
        executor = _executor(mode, k)
        study = _study()
        executor.optimize(study, trivial, n_trials=n_trials)
        new_executor_s.append(round(time.time() - start, 3))
        first_trial_s.append(round(min(t.user_attrs["t"] for t in study.trials) - start, 3))
        assert {t.state.name for t in study.trials} == {"COMPLETE"}
        executors.append(executor)
    row["new_executor_s"] = new_executor_s
    row["first_trial_s"] = first_trial_s
    for executor in executors[1:]:
        if mode != "threads":
            executor.close()
    executor = executors[0]
    # Memory while K trials are inside.
    for name, objective in (("sleeping", sleeper), ("training", trainer)):
        samples: list[dict[str, Any]] = []

        def sample(into: list[dict[str, Any]] = samples) -> None:
            time.sleep(1.0)
            into.append(_sample_memory())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        executor.optimize(_study(), objective, n_trials=k)
        sampler.join()
        row[f"memory_{name}"] = samples[0] if samples else None
    start = time.time()
    executor.optimize(_study(), trivial, n_trials=rate)
    row["trivial_per_s"] = round(rate / (time.time() - start), 1)
    if mode != "threads":
        row["crash_gap_s"] = _crash_gaps(mode, k=1)
        executor.close()
    return row


def _sample_memory() -> dict[str, Any]:
    tree = _process_tree()
    driver = _memory_mib(os.getpid())
    workers = [m for m in map(_memory_mib, tree["workers"]) if m is not None]
    zygotes = [m for m in map(_memory_mib, tree["zygotes"]) if m is not None]
    every = [m for m in (driver, *workers, *zygotes) if m is not None]
    return {
        "driver_uss_pss_mib": driver,
        "workers_uss_pss_mib": sorted(workers),
        "zygotes_uss_pss_mib": sorted(zygotes),
        "total_pss_mib": round(sum(pss for _, pss in every), 1),
    }


def _crash_gaps(mode: str, k: int) -> list[float]:
    import optuna

    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "crashes"
        os.environ["WW_CRASH_LOG"] = str(log)
        executor = _executor(mode, k)
        executor.optimize(_study(), trivial, n_trials=1)  # warm
        study = _study()
        executor.optimize(study, crasher, n_trials=6)
        executor.close()
        lines = [line.split() for line in log.read_text().splitlines() if line]
        killed = {int(number): float(at) for number, at in lines}
    trials = study.get_trials(deepcopy=False)
    gaps = []
    for trial in trials:
        if trial.number % 2 == 1 and trial.number - 1 in killed:
            gaps.append(round(trial.user_attrs["t"] - killed[trial.number - 1], 3))
    states = [t.state for t in trials]
    assert states == [optuna.trial.TrialState.FAIL, optuna.trial.TrialState.COMPLETE] * 3, states
    return gaps


_THREAD_EXIT = """
import sys, threading, optuna, waterwave_hpo as ww
optuna.logging.set_verbosity(optuna.logging.WARNING)

def objective(trial):
    return trial.suggest_float("x", 0.0, 1.0)

def run():
    study = optuna.create_study(storage="sqlite:///{db}", study_name="left")
    isolation = sys.argv[1]
    with ww.WaterwaveExecutor("cpu", 2, isolation=isolation) as executor:
        executor.optimize(study, objective, n_trials=6)

threading.Thread(target=run).start()
"""


def thread_exit(mode: str) -> dict[str, Any]:
    """Trial states when the main thread returns while a thread runs ``optimize``."""
    import optuna

    with tempfile.TemporaryDirectory() as folder:
        db = Path(folder) / "study.db"
        script = Path(folder) / "left.py"
        script.write_text(_THREAD_EXIT.format(db=db))
        env = dict(os.environ)
        if mode == "spawn":
            env["WATERWAVE_WORKER_START"] = "spawn"
        start = time.time()
        done = subprocess.run(
            [sys.executable, str(script), "threads" if mode == "threads" else "process"],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
            check=False,
        )
        wall_s = time.time() - start
        try:
            study = optuna.load_study(study_name="left", storage=f"sqlite:///{db}")
            states = [t.state.name for t in study.trials]
        except KeyError:
            states = []
    return {
        "mode": mode,
        "returncode": done.returncode,
        "states": states,
        "wall_s": round(wall_s, 2),
        "stderr_tail": done.stderr[-500:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rate", type=int, default=500)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.k, args.trials, args.rate)), flush=True)
        return
    import optuna
    import torch

    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for mode in args.modes:
            command = [sys.executable, __file__, "--child", mode, "--k", str(args.k)]
            done = subprocess.run(
                [*command, "--trials", str(args.trials), "--rate", str(args.rate)],
                capture_output=True,
                text=True,
                timeout=1800,
                check=False,
            )
            if done.returncode != 0:
                raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            row["repeat"] = repeat
            row["load"] = os.getloadavg()
            rows.append(row)
            print(json.dumps(row), flush=True)
        for mode in args.modes:
            row = thread_exit(mode)
            row["repeat"] = repeat
            rows.append({"thread_exit": row})
            print(json.dumps(row), flush=True)
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
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "rows": rows,
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "process_start.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
