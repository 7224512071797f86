"""Run the demo search and write its run directory."""

from __future__ import annotations

from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
import json
import os
from pathlib import Path
import platform
import sys
import time
from typing import Any

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState
import torch

from waterwave_hpo import _optuna_compat
from waterwave_hpo._version import __version__
from waterwave_hpo.demo._data import load_digits
from waterwave_hpo.demo._objective import make_objective
from waterwave_hpo.executor import WaterwaveExecutor
from waterwave_hpo.executor._attrs import ATTR_FAIL_REASON
from waterwave_hpo.executor._attrs import ATTR_RETRY_OF
from waterwave_hpo.executor._attrs import trial_attr
from waterwave_hpo.integrations.optuna import create_study
from waterwave_hpo.report import max_concurrent_trials
from waterwave_hpo.report import plot_timeline
from waterwave_hpo.report import trials_table

STUDY_NAME = "waterwave-demo"


@dataclass(frozen=True)
class DemoConfig:
    """The demo's settings (the ``waterwave-hpo demo`` flags).

    Attributes:
        trials: Total trials the study should hold when the run ends (a second run with the same
            ``out`` adds only the missing ones).
        concurrency: Trials run at once on each device (``trials_per_device``).
        epochs: Training epochs per trial.
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        seed: Seeds the sampler, each trial's initialization and its batch order.
        out: The run directory.
        show_progress_bar: Show a progress bar on stderr.
    """

    trials: int = 16
    concurrency: int = 4
    epochs: int = 5
    device: str = "auto"
    seed: int = 0
    out: Path = field(default_factory=lambda: Path("waterwave-demo"))
    show_progress_bar: bool = True


@dataclass(frozen=True)
class DemoResult:
    """What the demo wrote, and the summary it wrote to ``summary.json``."""

    out: Path
    summary: dict[str, Any]


def run_demo(config: DemoConfig) -> DemoResult:
    """Run the NAS + HPO search on the digits and write the run directory ``config.out``.

    Writes ``study.log`` (the study, in Optuna's journal file storage; an existing one is
    resumed), ``trials.csv`` (one row per trial), ``summary.json`` and ``timeline.png``.

    Raises:
        ValueError: If a setting is out of range or names a device that does not exist.
    """
    for name in ("trials", "concurrency", "epochs"):
        value = getattr(config, name)
        minimum = 0 if name == "trials" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name}={value!r} must be an int >= {minimum}.")
    executor = WaterwaveExecutor(
        devices=config.device, trials_per_device=config.concurrency, record_trial_attrs=True
    )
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)

    if all(device.type == "cpu" for device in executor.devices):
        # Co-hosted trials share the cores; one intra-op pool per trial would oversubscribe them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.concurrency))

    storage = JournalStorage(JournalFileBackend(str(out / "study.log")))
    study = create_study(
        storage=storage,
        study_name=STUDY_NAME,
        direction="maximize",
        load_if_exists=True,
        sampler=optuna.samplers.TPESampler(seed=config.seed, constant_liar=True),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=1),
    )
    _fail_stale_trials(study)
    done_before = _n_configurations(study)
    numbers_before = {t.number for t in study.get_trials(deepcopy=False)}
    to_run = max(0, config.trials - done_before)

    objective = make_objective(load_digits(), epochs=config.epochs, seed=config.seed)
    started = time.perf_counter()
    study.optimize(
        objective,
        n_trials=to_run,
        executor=executor,
        show_progress_bar=config.show_progress_bar,
    )
    wall_time_s = time.perf_counter() - started

    trials = study.get_trials(deepcopy=False)
    this_run = [t for t in trials if t.number not in numbers_before]
    trials_table(study).to_csv(out / "trials.csv", index=False)
    plot_timeline(
        this_run or trials,
        out / "timeline.png",
        title=(
            f"waterwave-hpo demo: {len(this_run or trials)} trials, "
            f"{config.concurrency} per device on {', '.join(map(str, executor.devices))}"
        ),
    )
    summary = _summary(study, config, executor, wall_time_s, this_run, to_run)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return DemoResult(out=out, summary=summary)


def _fail_stale_trials(study: optuna.Study) -> None:
    # A run killed hard (SIGKILL, power loss) leaves RUNNING trials in the journal; this run
    # owns the study, so they can only be stale.
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        _optuna_compat.set_system_attr(
            study,
            _optuna_compat.trial_id(trial),
            ATTR_FAIL_REASON,
            "stale: the run that started it never finished it",
        )
        study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)


def _n_configurations(study: optuna.Study) -> int:
    # Re-runs after an out-of-memory error repeat a configuration; they do not count.
    return sum(1 for t in study.get_trials(deepcopy=False) if trial_attr(t, ATTR_RETRY_OF) is None)


def _summary(
    study: optuna.Study,
    config: DemoConfig,
    executor: WaterwaveExecutor,
    wall_time_s: float,
    this_run: list[optuna.trial.FrozenTrial],
    requested: int,
) -> dict[str, Any]:
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state is TrialState.COMPLETE]
    best = max(complete, key=lambda t: t.value) if complete else None  # type: ignore[arg-type,return-value]
    settings = asdict(config)
    settings["out"] = str(config.out)
    return {
        "n_trials": len(trials),
        "n_complete": len(complete),
        "n_pruned": sum(1 for t in trials if t.state is TrialState.PRUNED),
        "n_fail": sum(1 for t in trials if t.state is TrialState.FAIL),
        "n_trials_this_run": len(this_run),
        "n_trials_requested_this_run": requested,
        "best_value": None if best is None else best.value,
        "best_trial": None if best is None else best.number,
        "best_params": None if best is None else best.params,
        "wall_time_s": round(wall_time_s, 3),
        "max_concurrent_trials": max_concurrent_trials(this_run or trials),
        "device": [str(device) for device in executor.devices],
        "device_name": _device_names(executor),
        "trials_per_device": executor.trials_per_device,
        "settings": settings,
        "versions": {
            "waterwave_hpo": __version__,
            "optuna": optuna.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _device_names(executor: WaterwaveExecutor) -> list[str]:
    names = []
    for device in executor.devices:
        if device.type == "cuda":
            names.append(torch.cuda.get_device_name(device))
        else:
            names.append(platform.processor() or platform.machine())
    return names
