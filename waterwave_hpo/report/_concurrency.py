"""How many trials ran at the same time, measured from the trials' own start and end times."""

from __future__ import annotations

from collections.abc import Iterable

from optuna.trial import FrozenTrial

from waterwave_hpo import _checks


def check_trials(name: str, trials: object) -> list[FrozenTrial]:
    """``trials`` as a list if it is an iterable of ``FrozenTrial`` (e.g. ``study.trials``).

    Raises:
        TypeError: It is not iterable, or holds something else.
    """
    fix = "pass study.trials or study.get_trials()"
    if not isinstance(trials, Iterable) or isinstance(trials, (str, bytes)):
        raise _checks.type_error(name, trials, "an iterable of optuna FrozenTrial", fix)
    result = list(trials)
    for index, trial in enumerate(result):
        if not isinstance(trial, FrozenTrial):
            raise _checks.type_error(f"{name}[{index}]", trial, "an optuna FrozenTrial", fix)
    return result


def max_concurrent_trials(trials: Iterable[FrozenTrial]) -> int:
    """The largest number of trials whose [start, complete) intervals overlap at one instant.

    Trials without both ``datetime_start`` and ``datetime_complete`` (waiting or still running)
    are ignored. A trial that ends at the instant another starts does not overlap it.

    Returns:
        0 when no trial has finished, otherwise at least 1.
    """
    events: list[tuple[float, int]] = []
    for trial in check_trials("trials", trials):
        if trial.datetime_start is None or trial.datetime_complete is None:
            continue
        events.append((trial.datetime_start.timestamp(), 1))
        events.append((trial.datetime_complete.timestamp(), -1))
    # Ends sort before starts at the same instant (-1 < 1).
    events.sort()
    running = best = 0
    for _, delta in events:
        running += delta
        best = max(best, running)
    return best
