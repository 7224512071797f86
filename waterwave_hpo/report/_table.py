"""One row per trial, as a pandas DataFrame (written to ``trials.csv`` by the demo)."""

from __future__ import annotations

import json
from typing import Any

import optuna
import pandas as pd

from waterwave_hpo import _checks
from waterwave_hpo.executor import trial_attr
from waterwave_hpo.executor import trial_memory_plan
from waterwave_hpo.host import ATTR_DEVICE
from waterwave_hpo.host import ATTR_FAIL_REASON
from waterwave_hpo.host import ATTR_PEAK_BYTES
from waterwave_hpo.host import ATTR_RETRY_OF
from waterwave_hpo.host import ATTR_SLOT

_COLUMNS = [
    "number",
    "state",
    "value",
    "params",
    "datetime_start",
    "datetime_complete",
    "duration_s",
    "device",
    "slot",
    "peak_bytes",
    "retry_of",
    "fail_reason",
    "plan_planner",
    "plan_budget_bytes",
    "plan_peak_bytes",
    "plan_step_s",
    "plan_choices",
]

_INT_COLUMNS = ("slot", "peak_bytes", "retry_of", "plan_budget_bytes", "plan_peak_bytes")


def trials_table(study: optuna.Study) -> pd.DataFrame:
    """The study's trials, one row each, in trial-number order.

    Columns: ``number``; ``state`` (COMPLETE, PRUNED, FAIL, RUNNING, WAITING); ``value`` (the
    objective value, or the last reported intermediate value of a pruned trial); ``params`` (a
    JSON object); ``datetime_start`` and ``datetime_complete`` (ISO 8601, local time);
    ``duration_s`` (seconds); ``device`` and ``slot`` (where ``WaterwaveExecutor`` ran it);
    ``peak_bytes`` (its peak allocated device memory, measured by its account in the
    stream-aware pool on CUDA; empty elsewhere);
    ``retry_of`` (the trial whose parameters it re-ran after an out-of-memory error);
    ``fail_reason``; ``plan_planner``, ``plan_budget_bytes``, ``plan_peak_bytes`` (predicted),
    ``plan_step_s`` (predicted seconds per step) and ``plan_choices`` (a JSON object, unit ->
    keep/swap/recompute): the memory plan its model ran with under
    ``WaterwaveExecutor(memory_plan="home")``, empty without one;
    ``device``, ``slot``, ``peak_bytes`` and ``fail_reason`` are filled for
    studies run with ``WaterwaveExecutor(record_trial_attrs=True)``, empty otherwise; then one
    ``param_<name>`` column per parameter. Multi-objective studies get
    ``value_0``, ``value_1``, ... instead of ``value``.
    """
    if not isinstance(study, optuna.Study):
        raise _checks.type_error(
            "study", study, "an optuna.Study", "pass the study, e.g. optuna.load_study(...)"
        )
    rows: list[dict[str, Any]] = []
    n_objectives = len(study.directions)
    param_names: list[str] = []
    for trial in study.get_trials(deepcopy=False):
        duration = (
            (trial.datetime_complete - trial.datetime_start).total_seconds()
            if trial.datetime_start is not None and trial.datetime_complete is not None
            else None
        )
        row: dict[str, Any] = {
            "number": trial.number,
            "state": trial.state.name,
            "params": json.dumps(trial.params, sort_keys=True),
            "datetime_start": _iso(trial.datetime_start),
            "datetime_complete": _iso(trial.datetime_complete),
            "duration_s": duration,
            "device": trial_attr(trial, ATTR_DEVICE),
            "slot": trial_attr(trial, ATTR_SLOT),
            "peak_bytes": trial_attr(trial, ATTR_PEAK_BYTES),
            "retry_of": trial_attr(trial, ATTR_RETRY_OF),
            "fail_reason": trial_attr(trial, ATTR_FAIL_REASON),
        }
        plan = trial_memory_plan(trial)
        row["plan_planner"] = None if plan is None else plan.planner
        row["plan_budget_bytes"] = None if plan is None else plan.budget_bytes
        row["plan_peak_bytes"] = None if plan is None else plan.predicted_peak_bytes
        row["plan_step_s"] = None if plan is None else plan.predicted_step_seconds
        row["plan_choices"] = None if plan is None else json.dumps(plan.choices)
        if n_objectives == 1:
            row["value"] = trial.value if trial.values is not None else _last_reported(trial)
        else:
            for i in range(n_objectives):
                row[f"value_{i}"] = trial.values[i] if trial.values is not None else None
        for name, value in trial.params.items():
            if name not in param_names:
                param_names.append(name)
            row[f"param_{name}"] = value
        rows.append(row)
    value_columns = ["value"] if n_objectives == 1 else [f"value_{i}" for i in range(n_objectives)]
    columns = [c for c in _COLUMNS if c != "value"]
    columns[2:2] = value_columns
    columns += [f"param_{name}" for name in param_names]
    table = pd.DataFrame(rows, columns=columns)
    for column in _INT_COLUMNS:  # empty where missing, never a float (6, not 6.0)
        table[column] = table[column].astype("Int64")
    return table


def _iso(moment: Any) -> str | None:
    return None if moment is None else moment.isoformat()


def _last_reported(trial: optuna.trial.FrozenTrial) -> float | None:
    if not trial.intermediate_values:
        return None
    return trial.intermediate_values[max(trial.intermediate_values)]
