"""Ctrl+C pressed repeatedly during a threaded study on SQLite: what is left, how fast it exits.

A child process runs four ~1 s trials at a time (each writes an intermediate value every 10 ms)
on a SQLite study, by

* ``executor``: ``WaterwaveExecutor(devices="cpu", trials_per_device=4)``;
* ``optuna``: Optuna's own ``study.optimize(n_jobs=4)`` (the reference; threads too).

Once four trials have started, the child gets ``--sigints`` SIGINTs ``--gap`` seconds apart,
while ``--busy`` busy-loop processes load the cores (another job on the machine). Per run:
the trials left RUNNING in the study afterwards, the seconds from the last SIGINT to
``optimize`` raising (``raised_s``, CLOCK_MONOTONIC is shared by the processes) and to the
child's exit (``exit_s``: the interpreter's own teardown included). Run:
``python experiments/ctrl_c.py --out DIR``; writes ``ctrl_c.json`` (machine, load, rows;
``--modes executor --name before`` for the executor alone into ``before.json``).
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
import time

import optuna

_CHILD = """
import sys, time
import optuna
import waterwave_hpo as ww

mode, url = sys.argv[1], sys.argv[2]
optuna.logging.set_verbosity(optuna.logging.WARNING)
study = optuna.create_study(storage=url, study_name="ctrl-c")

def objective(trial):
    print(f"started {trial.number}", flush=True)
    for step in range(100):
        time.sleep(0.01)
        trial.report(float(step), step)
    return 0.0

try:
    if mode == "executor":
        ww.WaterwaveExecutor(devices="cpu", trials_per_device=4).optimize(
            study, objective, n_trials=1000
        )
    else:
        study.optimize(objective, n_trials=1000, n_jobs=4)
finally:
    print(f"raised {time.monotonic()}", file=sys.stderr, flush=True)
"""


def run_once(mode: str, sigints: int, gap_s: float, directory: Path) -> dict[str, object]:
    """One interrupted run of ``mode``; what it left and when it ended."""
    url = f"sqlite:///{directory / f'{mode}.db'}"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, mode, url],
        cwd=directory,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    started = 0
    while started < 4:
        line = child.stdout.readline()
        if not line:
            raise RuntimeError(f"the child ended early: {child.communicate()[1][-2000:]}")
        started += line.startswith("started ")
    last = 0.0
    for _ in range(sigints):
        child.send_signal(signal.SIGINT)
        last = time.monotonic()
        time.sleep(gap_s)
    try:
        _, err = child.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        child.kill()
        _, err = child.communicate()
    exited = time.monotonic()
    raised = [float(line.split()[1]) for line in err.splitlines() if line.startswith("raised ")]
    study = optuna.load_study(study_name="ctrl-c", storage=url)
    states = [t.state.name for t in study.get_trials(deepcopy=False)]
    return {
        "mode": mode,
        "trials": len(states),
        "running_left": states.count("RUNNING"),
        "raised_s": round(raised[0] - last, 2) if raised else None,
        "exit_s": round(exited - last, 2),
        "returncode": child.returncode,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sigints", type=int, default=2)
    parser.add_argument("--gap", type=float, default=0.2)
    parser.add_argument("--busy", type=int, default=2)
    parser.add_argument("--modes", default="executor,optuna", help="comma-separated")
    parser.add_argument("--name", default="ctrl_c", help="the JSON file's name, without .json")
    args = parser.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    rows = []
    try:
        for run in range(args.runs):
            for mode in args.modes.split(","):
                with tempfile.TemporaryDirectory() as directory:
                    row = run_once(mode, args.sigints, args.gap, Path(directory))
                row["run"] = run
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for process in busy:
            process.kill()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "python": platform.python_version(),
        "optuna": optuna.__version__,
        "load_average_at_end": os.getloadavg(),
        "sigints": args.sigints,
        "gap_s": args.gap,
        "busy_loops": args.busy,
        "rows": rows,
    }
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
