"""Kill the demo with SIGKILL at random moments, resume it each time, and count what was lost.

A resume after ``kill -9`` must complete in bounded time, the journal must load, no
trial may stay RUNNING and the finished count must be what ``--trials`` asked for (interrupted
trials do not count; their parameters run again). Each round starts
``python -m waterwave_hpo demo`` on the same ``--out`` (so every round after the first is a
resume), waits until it has opened the journal (its heartbeat is in ``study.log``: the lock was
taken and the journal checked) and kills it with SIGKILL in one of three ways, in turn:

- ``random``: 0-``--max-delay-s`` seconds later, wherever it is;
- ``holding-lock``: the moment it holds the journal lock (polling ``study.log.lock`` for its
  pid), so the lock is left behind;
- ``mid-append``: as ``holding-lock``, then the last line of ``study.log`` is cut at a random
  byte, as a kill inside Optuna's ``write`` leaves it (that instant cannot be hit from outside,
  so the cut is made by hand; it is what such a kill leaves).

After each kill, the journal must load in plain Optuna. Then a last resume runs to the end.

    python experiments/demo_kill_resume.py --kills 30 --write

writes ``experiments/results/<date>-demo-kill-resume/`` (results.json, README.md). The test
``tests/demo/test_kill_resume.py`` runs the same rounds (21 kills) in CI.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
import datetime
import enum
import json
import os
from pathlib import Path
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

STUDY_NAME = "waterwave-demo"


class KillMode(str, enum.Enum):
    """When a round's SIGKILL lands."""

    RANDOM = "random"
    HOLDING_LOCK = "holding-lock"
    MID_APPEND = "mid-append"


@dataclass
class KillRound:
    """One start of the demo and its SIGKILL."""

    mode: KillMode
    ready_s: float
    """Seconds from start until the journal was open (lock taken, journal checked)."""
    killed_after_ready_s: float
    lock_left_behind: bool
    cut_bytes: int
    """Bytes of the last line left after a ``mid-append`` cut (0 otherwise)."""
    finished_trials_after: int
    running_trials_after: int


@dataclass
class KillReport:
    """What the rounds did and what the final resume found."""

    settings: dict[str, Any]
    rounds: list[KillRound] = field(default_factory=list)
    final_resume_s: float = 0.0
    final_returncode: int | None = None
    counted_finished: int = 0
    running_left: int = 0
    waiting_left: int = 0
    interrupted: int = 0
    trials_lost: int = 0
    """Interrupted trials whose parameters did not run again to the end."""
    total_trials_in_journal: int = 0
    final_stderr_tail: str = ""


def _command(out: Path, trials: int, epochs: int, concurrency: int, seed: int) -> list[str]:
    return [
        sys.executable, "-m", "waterwave_hpo", "demo", "--device", "cpu", "--no-progress",
        "--trials", str(trials), "--epochs", str(epochs), "--concurrency", str(concurrency),
        "--seed", str(seed), "--out", str(out),
    ]  # fmt: skip


def _heartbeat_seen(journal: Path, pid: int) -> bool:
    try:
        data = journal.read_bytes()
    except FileNotFoundError:
        return False
    return f'"waterwave:heartbeat:{socket.gethostname()}:{pid}:'.encode() in data


def _lock_holder(lock: Path) -> int | None:
    try:
        record = json.loads(lock.read_text())
        return int(record["holder"]["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _load_trials(journal: Path) -> list[Any]:
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    # Plain Optuna, read only: load_study appends nothing.
    storage = JournalStorage(JournalFileBackend(str(journal)))
    return list(optuna.load_study(study_name=STUDY_NAME, storage=storage).trials)


def run_kills(
    out: Path,
    kills: int = 21,
    trials: int = 24,
    epochs: int = 1,
    concurrency: int = 2,
    seed: int = 0,
    max_delay_s: float = 2.5,
    ready_timeout_s: float = 120.0,
    final_timeout_s: float = 600.0,
    rng_seed: int = 0,
) -> KillReport:
    """Run ``kills`` kill-and-resume rounds on ``out``, then a last resume to the end.

    Raises:
        AssertionError: If a resume does not open the journal within ``ready_timeout_s``, or
            the journal does not load after a kill.
    """
    rng = random.Random(rng_seed)
    out.mkdir(parents=True, exist_ok=True)
    journal = out / "study.log"
    lock = out / "study.log.lock"
    command = _command(out, trials, epochs, concurrency, seed)
    report = KillReport(settings={
        "kills": kills, "trials": trials, "epochs": epochs, "concurrency": concurrency,
        "seed": seed, "max_delay_s": max_delay_s, "rng_seed": rng_seed,
        "command": " ".join(command[1:]),
    })  # fmt: skip
    modes = list(KillMode)
    for index in range(kills):
        mode = modes[index % len(modes)]
        started = time.monotonic()
        process = subprocess.Popen(
            command, cwd=out.parent, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            while not _heartbeat_seen(journal, process.pid):
                if time.monotonic() - started > ready_timeout_s:
                    raise AssertionError(
                        f"round {index}: the resume did not open the journal in "
                        f"{ready_timeout_s} s (a lock waited on forever?)"
                    )
                if process.poll() is not None:
                    break  # finished already (the study was complete)
                time.sleep(0.01)
            ready_s = time.monotonic() - started
            if mode is KillMode.RANDOM:
                time.sleep(rng.uniform(0.0, max_delay_s))
            else:
                deadline = time.monotonic() + 30.0
                while _lock_holder(lock) != process.pid and time.monotonic() < deadline:
                    if process.poll() is not None:
                        break
                    time.sleep(0.0005)
            killed_after_ready_s = time.monotonic() - started - ready_s
            process.send_signal(signal.SIGKILL)
        finally:
            process.kill()
            process.wait()
        cut = 0
        if mode is KillMode.MID_APPEND:
            data = journal.read_bytes()
            last_start = data.rstrip(b"\n").rfind(b"\n") + 1
            cut = rng.randrange(1, len(data) - last_start)  # keep 1 .. len-1 bytes of it
            journal.write_bytes(data[: last_start + cut])
        loaded = _load_trials(journal)  # raises if the journal does not load
        report.rounds.append(
            KillRound(
                mode=mode,
                ready_s=round(ready_s, 3),
                killed_after_ready_s=round(killed_after_ready_s, 3),
                lock_left_behind=os.path.lexists(lock),
                cut_bytes=cut,
                finished_trials_after=sum(1 for t in loaded if t.state.is_finished()),
                running_trials_after=sum(1 for t in loaded if t.state.name == "RUNNING"),
            )
        )

    started = time.monotonic()
    final = subprocess.run(
        command, cwd=out.parent, capture_output=True, text=True, timeout=final_timeout_s
    )
    report.final_resume_s = round(time.monotonic() - started, 3)
    report.final_returncode = final.returncode
    report.final_stderr_tail = final.stderr[-2000:]
    loaded = _load_trials(journal)
    rerun_of = {
        t.system_attrs["waterwave:rerun_of"]: t
        for t in loaded
        if "waterwave:rerun_of" in t.system_attrs
    }
    interrupted = [t for t in loaded if t.number in rerun_of]

    def last_rerun(number: int) -> Any:
        # A re-run may itself be interrupted and re-run: follow the chain to its end.
        trial = rerun_of[number]
        while trial.number in rerun_of:
            trial = rerun_of[trial.number]
        return trial

    report.total_trials_in_journal = len(loaded)
    report.interrupted = len(interrupted)
    report.running_left = sum(1 for t in loaded if t.state.name == "RUNNING")
    report.waiting_left = sum(1 for t in loaded if t.state.name == "WAITING")
    report.counted_finished = sum(
        1 for t in loaded if t.state.is_finished() and t.number not in rerun_of
    )
    report.trials_lost = sum(
        1
        for t in interrupted
        if not (
            last_rerun(t.number).state.is_finished()
            and t.params.items() <= last_rerun(t.number).params.items()
        )
    )
    return report


def main() -> None:
    """Run the rounds and print (or ``--write``) the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--rng-seed", type=int, default=0)
    parser.add_argument("--write", action="store_true", help="write experiments/results/...")
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        report = run_kills(
            Path(tmp) / "run",
            kills=args.kills,
            trials=args.trials,
            epochs=args.epochs,
            concurrency=args.concurrency,
            rng_seed=args.rng_seed,
        )
    import optuna
    import torch

    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
        },
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "versions": {
            "python": platform.python_version(),
            "optuna": optuna.__version__,
            "torch": torch.__version__,
        },
        "command": "python experiments/demo_kill_resume.py " + " ".join(sys.argv[1:]),
        **asdict(report),
    }
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.write:
        folder = (
            Path(__file__).parent
            / "results"
            / f"{datetime.date.today().isoformat()}-demo-kill-resume"
        )
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "results.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
