"""Run the demo search and write its run directory."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
import json
import logging
import math
import os
from pathlib import Path
import platform
import re
import sys
import tempfile
import threading
import time
from typing import Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState
import pandas as pd
import torch

from waterwave_hpo import _checks
from waterwave_hpo import _optuna_compat
from waterwave_hpo import _owned_files
from waterwave_hpo._version import __version__
from waterwave_hpo.demo._data import load_digits
from waterwave_hpo.demo._fused import make_fused_objective
from waterwave_hpo.demo._journal import open_journal
from waterwave_hpo.demo._liveness import Heartbeat
from waterwave_hpo.demo._liveness import LivenessRule
from waterwave_hpo.demo._liveness import counted_trials
from waterwave_hpo.demo._liveness import owner_of
from waterwave_hpo.demo._liveness import record_owner
from waterwave_hpo.demo._liveness import requeue
from waterwave_hpo.demo._liveness import requeue_and_fail
from waterwave_hpo.demo._liveness import rerun_of
from waterwave_hpo.demo._liveness import stale_trials
from waterwave_hpo.demo._objective import make_objective
from waterwave_hpo.demo._process import ProcessIdentity
from waterwave_hpo.demo._process import this_process
from waterwave_hpo.demo._study import demo_pruner
from waterwave_hpo.demo._study import demo_sampler
from waterwave_hpo.executor import Isolation
from waterwave_hpo.executor import WaterwaveExecutor
from waterwave_hpo.executor import batched
from waterwave_hpo.host import ATTR_FAIL_REASON
from waterwave_hpo.integrations.optuna import create_study
from waterwave_hpo.integrations.optuna import load_study
from waterwave_hpo.report import max_concurrent_trials
from waterwave_hpo.report import plot_timeline
from waterwave_hpo.report import trials_table

STUDY_NAME = "waterwave-demo"
JOURNAL_NAME = "study.log"
DEMO_FILES = (JOURNAL_NAME, JOURNAL_NAME + ".lock", "trials.csv", "summary.json", "timeline.png")
"""Every file the demo writes in ``out`` (beside its manifest, ``waterwave-run.json``)."""
ATTR_SETTINGS = "waterwave:demo_settings"
"""Study system attribute: the settings that change the objective, checked on resume."""
_OBJECTIVE_SETTINGS = ("epochs", "seed", "fuse")

_logger = logging.getLogger("waterwave_hpo.demo")


@dataclass(frozen=True)
class DemoConfig:
    """The demo's settings (the ``waterwave-hpo demo`` flags).

    Attributes:
        trials: Total trials the study should hold when the run ends (a second run with the same
            ``out`` adds only the missing ones).
        concurrency: Trials run at once on each device (``trials_per_device``).
        epochs: Training epochs per trial.
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        seed: Seeds the sampler (repeatable parameters with ``concurrency=1``; with more, which
            trial sees which finished neighbours depends on timing) and each trial's torch
            generator, from the seed and the trial number (repeatable training given the
            parameters, at any concurrency).
        out: The run directory.
        show_progress_bar: Show a progress bar on stderr.
        fuse: ``None``: the NAS + HPO search, one model per trial. ``K``: a numbers-only
            search (learning rate, weight decay, momentum, dropout) of one MLP structure,
            each slot training up to K trials as one fused model
            (:func:`waterwave_hpo.demo.make_fused_objective`, ``WaterwaveExecutor(fuse=K)``).
        isolation: ``"threads"`` (default) or ``"process"``: each slot trains its trials in a
            worker process (``WaterwaveExecutor(isolation="process")``).
    """

    trials: int = 16
    concurrency: int = 4
    epochs: int = 5
    device: str = "auto"
    seed: int = 0
    out: Path = field(default_factory=lambda: Path("waterwave-demo"))
    show_progress_bar: bool = True
    fuse: int | None = None
    isolation: str = "threads"


@dataclass(frozen=True)
class DemoResult:
    """What the demo wrote, and the summary it wrote to ``summary.json``."""

    out: Path
    summary: dict[str, Any]
    interrupted: bool = False
    """Whether Ctrl+C stopped the run (the files hold what finished)."""


class DemoSettingError(ValueError):
    """A demo setting is wrong; it names the setting, so the CLI can name its flag.

    Attributes:
        setting: The :class:`DemoConfig` field (``--<setting>`` on the command line).
        value: The value given.
        problem: What is wrong and the fix.
    """

    def __init__(
        self, setting: str, value: object, problem: str, cli_problem: str | None = None
    ) -> None:
        self.setting = setting
        self.value = value
        self.problem = problem
        self.cli_problem = problem if cli_problem is None else cli_problem
        super().__init__(f"{setting}={value!r}: {problem}")

    @property
    def flag_message(self) -> str:
        """The message in the command line's terms, e.g. ``--device cuda:9: ...``."""
        return f"--{self.setting.replace('_', '-')} {self.value}: {self.cli_problem}"


def run_demo(config: DemoConfig, liveness: LivenessRule | None = None) -> DemoResult:
    """Run the NAS + HPO search on the digits and write the run directory ``config.out``.

    Writes ``study.log`` (the study, in Optuna's journal file storage; an existing one is
    resumed), ``trials.csv`` (one row per trial), ``summary.json`` and ``timeline.png``.

    Resuming is safe after any kill and beside other demo processes on the same ``out``:
    the journal is opened by :func:`open_journal` (absolute path, a lock that names its holder,
    a cut last line repaired); RUNNING trials whose process is gone (see
    :mod:`waterwave_hpo.demo._liveness`) are failed and their parameters queued again; they do
    not count toward ``trials``, their re-runs do. On Ctrl+C the trials that were running are
    failed by the executor and queued again the same way, the files are written for what
    finished, and the result says it was interrupted.

    Args:
        config: The settings.
        liveness: Heartbeat interval and grace period for trials of other processes
            (default :class:`LivenessRule`).

    Raises:
        DemoSettingError: If a setting is out of range, names a device that does not exist,
            ``out`` is not a writable directory, or ``epochs``/``seed`` differ from those the
            study in ``out`` was run with.
        JournalDamagedError: If ``out/study.log`` is damaged beyond a cut last line.
    """
    for name in ("trials", "concurrency", "epochs"):
        value = getattr(config, name)
        minimum = 0 if name == "trials" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise DemoSettingError(
                name, value, f"must be an int >= {minimum}; pass an int >= {minimum}."
            )
    try:
        _checks.check_seed("seed", config.seed)
    except (TypeError, ValueError) as error:
        raise DemoSettingError("seed", config.seed, str(error).split(": ", 1)[1]) from None
    if config.fuse is not None and (
        isinstance(config.fuse, bool) or not isinstance(config.fuse, int) or config.fuse < 1
    ):
        raise DemoSettingError(
            "fuse",
            config.fuse,
            "must be an int >= 1 (trials per fused model); pass e.g. 4, or None to train one "
            "model per trial.",
        )
    try:
        executor = WaterwaveExecutor(
            devices=config.device,
            trials_per_device=config.concurrency,
            record_trial_attrs=True,
            fuse=config.fuse,
            isolation=config.isolation,
        )
    except (TypeError, ValueError) as error:
        raise _setting_error(config, error) from error
    folder = _claim_out(config.out)
    out = folder.path
    rule = liveness or LivenessRule()

    if all(device.type == "cpu" for device in executor.devices):
        # Co-hosted trials share the cores; one intra-op pool per trial would oversubscribe them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.concurrency))

    storage = open_journal(out / JOURNAL_NAME, grace_period_s=rule.grace_period_s)
    sampler = demo_sampler(config.seed)
    pruner = demo_pruner()
    if _holds_demo_study(storage, config.out, out / JOURNAL_NAME):
        # Resume without create_study: its create-study record would be appended (a duplicate)
        # even when the resume is refused below.
        study = load_study(study_name=STUDY_NAME, storage=storage, sampler=sampler, pruner=pruner)
    else:
        study = create_study(
            storage=storage,
            study_name=STUDY_NAME,
            direction="maximize",
            load_if_exists=True,  # another demo process may create it at the same moment
            sampler=sampler,
            pruner=pruner,
        )
    _check_objective_settings(study, config, out)
    me = this_process()
    objective = _OwnedObjective(
        make_objective(load_digits(), epochs=config.epochs, seed=config.seed), me
    )
    func: Callable[[Any], Any] = objective
    if config.fuse is not None:
        objective = _OwnedObjective(
            make_fused_objective(load_digits(), epochs=config.epochs, seed=config.seed), me
        )
        func = batched(objective.run_batch)
    interrupted = False
    with Heartbeat(study, me, rule):
        for trial, why in stale_trials(study, me, rule):
            if requeue_and_fail(study, trial, f"interrupted: {why}"):
                _logger.warning(
                    "Trial %d was left RUNNING but %s: failed it; its parameters run again.",
                    trial.number,
                    why,
                )
        numbers_before = {t.number for t in study.get_trials(deepcopy=False)}
        to_run = max(0, config.trials - len(counted_trials(study.get_trials(deepcopy=False))))
        started = time.perf_counter()
        try:
            study.optimize(
                func,
                n_trials=to_run,
                executor=executor,
                # A neighbour process that wrongly failed one of our running trials makes its
                # report() raise; that trial ends, the others go on.
                catch=(UpdateFinishedTrialError,),
                show_progress_bar=config.show_progress_bar,
            )
        except KeyboardInterrupt:
            interrupted = True
            _requeue_interrupted(
                study, objective, me, numbers_before, executor.isolation is Isolation.PROCESS
            )
        wall_time_s = time.perf_counter() - started

    trials = study.get_trials(deepcopy=False)
    this_run = [t for t in trials if t.number not in numbers_before and t.state.is_finished()]
    csv = _trials_csv(study)
    folder.write("trials.csv", lambda path: path.write_bytes(csv))
    title = timeline_title(
        len(this_run or trials), config.concurrency, config.fuse, executor.devices
    )
    folder.write("timeline.png", lambda path: plot_timeline(this_run or trials, path, title=title))
    summary = _summary(study, config, executor, wall_time_s, this_run, to_run)
    summary["interrupted"] = interrupted
    summary["out"] = str(out)
    folder.write_text("summary.json", json.dumps(summary, indent=2) + "\n")
    return DemoResult(out=out, summary=summary, interrupted=interrupted)


def _trials_csv(study: optuna.Study) -> bytes:
    """``trials.csv``'s bytes: the report's trials table with the demo's ``rerun_of`` column."""
    table = trials_table(study)
    after = list(table.columns).index("retry_of") + 1 if "retry_of" in table else len(table.columns)
    reruns = {t.number: rerun_of(t) for t in study.get_trials(deepcopy=False)}
    numbers = [reruns.get(number) for number in table["number"]]
    table.insert(after, "rerun_of", pd.array(numbers, dtype="Int64"))  # 6, not 6.0
    text: str = table.to_csv(index=False)
    return text.encode()


class _OwnedObjective:
    """The demo's objective, recording its owner first and why a trial failed by itself."""

    def __init__(self, objective: Callable[[Any], Any], me: ProcessIdentity) -> None:
        self._objective = objective
        self._me = me
        self._lock = threading.Lock()
        self.failed_by_itself: set[int] = set()
        """Trials whose objective raised (its own error) or returned no finite float."""

    def __getstate__(self) -> dict[str, Any]:
        # Sent to worker processes (isolation="process"): a lock cannot be pickled.
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __call__(self, trial: optuna.trial.Trial) -> float:
        record_owner(trial, self._me)
        try:
            value: float = self._objective(trial)
        except (optuna.TrialPruned, UpdateFinishedTrialError):
            # Pruned; or finished by someone else (the executor on Ctrl+C, before it stops this
            # thread; a neighbour process): not a failure of the trial's own.
            raise
        except Exception:
            with self._lock:
                self.failed_by_itself.add(trial.number)
            raise
        reason = _invalid_value_reason(value)
        if reason is not None:
            with self._lock:
                self.failed_by_itself.add(trial.number)
            # Optuna fails such a trial when told; keep why where trials.csv reads it.
            _optuna_compat.set_system_attr(
                trial.study, _optuna_compat.trial_id(trial), ATTR_FAIL_REASON, reason
            )
        return value

    def run_batch(self, trials: list[optuna.trial.Trial]) -> list[object]:
        """The fused demo's batch: record the owner of each trial, run, note own failures."""
        for trial in trials:
            record_owner(trial, self._me)
        try:
            entries: list[object] = list(self._objective(trials))
        except (optuna.TrialPruned, UpdateFinishedTrialError):
            raise
        except Exception:
            with self._lock:
                self.failed_by_itself.update(t.number for t in trials)
            raise
        for trial, entry in zip(trials, entries, strict=False):
            if isinstance(entry, optuna.TrialPruned):
                continue
            reason = (
                f"{type(entry).__name__}: {entry}"
                if isinstance(entry, BaseException)
                else _invalid_value_reason(entry)
            )
            if reason is not None:
                with self._lock:
                    self.failed_by_itself.add(trial.number)
                _optuna_compat.set_system_attr(
                    trial.study, _optuna_compat.trial_id(trial), ATTR_FAIL_REASON, reason
                )
        return entries


def _invalid_value_reason(value: object) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"the objective returned {value!r} ({type(value).__name__}), not a float"
    if not math.isfinite(value):
        return f"the objective returned {value!r}, not a finite float"
    return None


def _requeue_interrupted(
    study: optuna.Study,
    objective: _OwnedObjective,
    me: ProcessIdentity,
    numbers_before: set[int],
    isolated: bool = False,
) -> None:
    # The executor told every running trial FAIL (also one asked but not yet in the objective,
    # which names no owner); queue their parameters again. A trial that failed by itself stays a
    # counted FAIL. In worker processes (isolated) the objective's own record of that stays in
    # the worker: the executor's reason tells an interrupted trial instead.
    trials = study.get_trials(deepcopy=False)
    has_rerun = {n for n in map(rerun_of, trials) if n is not None}
    for trial in trials:
        owner = owner_of(trial)
        if (
            trial.state is TrialState.FAIL
            and (owner == me or (owner is None and trial.number not in numbers_before))
            and trial.number not in objective.failed_by_itself
            and (
                not isolated
                or str(trial.system_attrs.get(ATTR_FAIL_REASON, "")).startswith(
                    "optimize() was interrupted"
                )
            )
            and trial.number not in has_rerun
        ):
            requeue(study, trial)


def _claim_out(out: Path) -> _owned_files.OwnedFolder:
    """``out`` claimed for the demo's files, or refused before anything is written in it."""
    try:
        path = _owned_files.check_out_value("out", out)
    except _owned_files.OutFolderError as error:
        raise DemoSettingError("out", out, error.detail) from None
    _writable_directory(path, out)
    try:
        return _owned_files.claim_folder(
            out,
            kind="demo",
            names=DEMO_FILES,
            appended=DEMO_FILES[:2],  # the journal and its lock: appended and taken in place
            recognise=_EARLIER_DEMO_FILES,
        )
    except _owned_files.OutFolderError as error:
        raise DemoSettingError("out", out, error.detail) from None
    except OSError as error:
        raise DemoSettingError(
            "out",
            out,
            f"is not a directory the demo can write ({error.strerror or error}). Pass a "
            "directory you can write to.",
        ) from error


def _is_demo_journal(path: Path) -> bool:
    """Whether ``path`` starts with the record that created the demo's study (Optuna journal)."""
    try:
        with open(path, "rb") as file:
            first = file.readline(1 << 16)
        record = json.loads(first)
    except (OSError, ValueError):
        return False
    return (
        isinstance(record, dict)
        and record.get("op_code") == 0
        and record.get("study_name") == STUDY_NAME
        and first.endswith(b"\n")
    )


def _in_earlier_demo_run(check: Callable[[Path], bool]) -> Callable[[Path], bool]:
    # A file beside a journal of the demo's study, of the demo's format: a run directory an
    # earlier version wrote without a manifest.
    return lambda path: _is_demo_journal(path.parent / JOURNAL_NAME) and check(path)


def _is_the_journals_table(path: Path) -> bool:
    """Whether ``path`` holds exactly the ``trials.csv`` the journal beside it gives.

    Only then is an earlier run's table (no manifest recorded its bytes) the demo's to rewrite:
    one the user annotated since differs, and is refused rather than lost.
    """
    try:
        storage = JournalStorage(JournalFileBackend(str(path.parent / JOURNAL_NAME)))
        study = optuna.load_study(study_name=STUDY_NAME, storage=storage)
        return path.read_bytes() == _trials_csv(study)
    except Exception:  # an unreadable journal or table: not recognised
        return False


def _json_object_with(path: Path, key: str) -> bool:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and key in data


def _starts_with(prefix: bytes) -> Callable[[Path], bool]:
    def check(path: Path) -> bool:
        with open(path, "rb") as file:
            return file.read(len(prefix)) == prefix

    return check


_EARLIER_DEMO_FILES: dict[str, Callable[[Path], bool]] = {
    JOURNAL_NAME: _is_demo_journal,
    JOURNAL_NAME + ".lock": _in_earlier_demo_run(lambda path: _json_object_with(path, "holder")),
    "trials.csv": _in_earlier_demo_run(_is_the_journals_table),
    "summary.json": _in_earlier_demo_run(lambda path: _json_object_with(path, "n_trials")),
    "timeline.png": _in_earlier_demo_run(_starts_with(b"\x89PNG\r\n\x1a\n")),
}
"""Format checks that recognise a run directory of an earlier demo (written without manifest)."""


def _writable_directory(path: Path, out: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise DemoSettingError(
            "out",
            out,
            f"is not a directory the demo can write ({error.strerror or error}). Pass a "
            "directory you can write to.",
        ) from error
    return path


def _holds_demo_study(storage: optuna.storages.BaseStorage, out_flag: Path, path: Path) -> bool:
    """Whether the journal holds the demo's study; refuse one holding other studies.

    Raises:
        DemoSettingError: The journal holds another study (another project's journal): the demo
            would append its own study into it.
    """
    names = {summary.study_name for summary in storage.get_all_studies()}
    others = sorted(names - {STUDY_NAME})
    if others:
        raise DemoSettingError(
            "out",
            out_flag,
            f"{path} is an Optuna journal of other studies ({', '.join(map(repr, others))}), not "
            "the demo's; the demo writes nothing into it. Pass a new directory, or the "
            "directory of an earlier demo run to resume it.",
        )
    return STUDY_NAME in names


def _check_objective_settings(study: optuna.Study, config: DemoConfig, out: Path) -> None:
    # Trials trained for other epochs or from another seed are not comparable: refuse to mix.
    ours = {name: getattr(config, name) for name in _OBJECTIVE_SETTINGS}
    stored = _optuna_compat.study_system_attrs(study).get(ATTR_SETTINGS)
    if not isinstance(stored, dict):
        _optuna_compat.set_study_system_attr(study, ATTR_SETTINGS, ours)
        return
    for name, value in ours.items():
        if name in stored and stored[name] != value:
            before = stored[name]
            problem = (
                "the study in {out} was run with {before}; trials of both would be compared as "
                "one search. Resume with {before}, or start a new study in another {new}."
            )
            raise DemoSettingError(
                name,
                value,
                problem.format(out=out, before=f"{name}={before!r}", new="out"),
                problem.format(out=out, before=f"--{name} {before}", new="--out"),
            )


_EXECUTOR_SETTINGS = {
    "devices": "device",
    "trials_per_device": "concurrency",
    "fuse": "fuse",
    "isolation": "isolation",
}


def _setting_error(config: DemoConfig, error: Exception) -> DemoSettingError:
    """The executor's refusal of a demo setting, naming the setting (and its flag) once."""
    text = str(error)
    # The executor's messages read "devices entry='cuda:9': problem; fix."
    match = re.match(r"(\w+)(?: entry)?=.*?: (.*)$", text, flags=re.DOTALL)
    argument, problem = (match.group(1), match.group(2)) if match else ("devices", text)
    setting = _EXECUTOR_SETTINGS.get(argument, "device")
    return DemoSettingError(setting, getattr(config, setting), problem, _device_flags(problem))


def _device_flags(text: str) -> str:
    # The executor's messages name its argument (devices='cuda:9'); the CLI's user typed --device.
    text = re.sub(r"devices(?: entry)?='([^']*)'", r"--device \1", text)
    return re.sub(r"(?<![-\w])devices='?(\w+)'?", r"--device \1", text)


def _summary(
    study: optuna.Study,
    config: DemoConfig,
    executor: WaterwaveExecutor,
    wall_time_s: float,
    this_run: list[optuna.trial.FrozenTrial],
    requested: int,
) -> dict[str, Any]:
    all_trials = study.get_trials(deepcopy=False)
    trials = counted_trials(all_trials)  # toward --trials: not the interrupted, not OOM re-runs
    complete = [t for t in trials if t.state is TrialState.COMPLETE]
    best = max(complete, key=lambda t: t.value) if complete else None  # type: ignore[arg-type,return-value]
    settings = asdict(config)
    settings["out"] = str(config.out)
    return {
        "n_trials": len(trials),
        "n_complete": len(complete),
        "n_pruned": sum(1 for t in trials if t.state is TrialState.PRUNED),
        "n_fail": sum(1 for t in trials if t.state is TrialState.FAIL),
        "n_running": sum(1 for t in trials if t.state is TrialState.RUNNING),
        "n_interrupted": sum(1 for t in all_trials if rerun_of(t) is not None),
        "n_waiting": sum(1 for t in all_trials if t.state is TrialState.WAITING),
        "n_trials_this_run": len({t.number for t in this_run} & {t.number for t in trials}),
        "n_trials_requested_this_run": requested,
        "best_value": None if best is None else best.value,
        "best_trial": None if best is None else best.number,
        "best_params": None if best is None else best.params,
        "wall_time_s": round(wall_time_s, 3),
        "max_concurrent_trials": max_concurrent_trials(
            this_run or [t for t in trials if t.state.is_finished()]
        ),
        "device": [str(device) for device in executor.devices],
        "device_name": _device_names(executor),
        "trials_per_device": executor.trials_per_device,
        "fuse": config.fuse,
        "isolation": executor.isolation.value,
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


def timeline_title(
    n_trials: int, concurrency: int, fuse: int | None, devices: Sequence[torch.device]
) -> str:
    """The demo timeline's title: what ran at once, with ``fuse`` and ``K`` named as such.

    ``concurrency`` is ``trials_per_device`` (K): slots per device; with ``fuse`` each slot runs
    a batch of up to ``fuse`` trials as one fused model, so up to ``K * fuse`` trials at once.
    """
    where = ", ".join(map(str, devices))
    if fuse is None:
        return f"waterwave-hpo demo: {n_trials} trials, K={concurrency} per device on {where}"
    return (
        f"waterwave-hpo demo: {n_trials} trials, fuse={fuse} trials per fused model, "
        f"K={concurrency} fused batch(es) per device on {where} "
        f"(up to {concurrency * fuse} trials at once)"
    )
