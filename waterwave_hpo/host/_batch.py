"""Batched objectives: a slot runs up to ``fuse`` trials at once, as one call, and ends each alone.

Horizontal fusion (HFTA: Wang et al., "Horizontally Fused Training Array", MLSys 2021,
arXiv:2102.02344) trains K models of one structure as one model whose operators are batched.
The executor's side of it is here: :func:`batched` marks an objective that takes a list of
trials, ``WaterwaveExecutor(fuse=K)`` hands each slot up to K trials, and the one run path of a
trial (``host/_attempt.py``: a single trial is a batch of one) runs the objective once and tells
the study every trial's own outcome (its value, PRUNED or FAIL), so that one trial's failure,
pruning or NaN touches no other trial of its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
import functools
from typing import Generic
from typing import TypeVar

import optuna

from waterwave_hpo import _checks

R = TypeVar("R")


class BatchedObjective(Generic[R]):
    """An objective that runs a list of trials at once; made by :func:`batched`.

    Calling it calls the wrapped function with the same list of trials.
    """

    def __init__(self, func: Callable[[list[optuna.trial.Trial]], Sequence[R]]) -> None:
        self.func = func
        functools.update_wrapper(self, func)

    def __call__(self, trials: list[optuna.trial.Trial]) -> Sequence[R]:
        """Run the wrapped objective on ``trials``; returns its entries, one per trial."""
        return self.func(trials)

    def __repr__(self) -> str:
        return f"batched({getattr(self.func, '__qualname__', self.func)!r})"


def batched(
    func: Callable[[list[optuna.trial.Trial]], Sequence[R]],
) -> BatchedObjective[R]:
    """Mark ``func`` as a batched objective: it runs a list of trials at once.

    Run it with ``WaterwaveExecutor(fuse=K)``: each slot asks the study for up to K trials
    and calls ``func(trials)`` once, so the objective can train their models as one fused
    model (``waterwave_hpo.fusion.fuse``; HFTA, arXiv:2102.02344). Each trial keeps its own
    ``trial.report``/``trial.should_prune`` and its own outcome. ``func`` returns one entry
    per trial, in the order of ``trials``:

    - a float (a sequence of floats for a multi-objective study): the trial is told COMPLETE
      with it; NaN, or the wrong number of values, fails that trial alone (Optuna's rule for
      one trial's value);
    - an ``optuna.TrialPruned`` instance: the trial is told PRUNED;
    - any other exception instance: the trial is told FAIL with it as the reason (whatever
      ``catch`` says: the objective caught it for that trial); its batch-mates go on.

    If ``func`` itself raises, the whole batch shares the outcome: ``optuna.TrialPruned``
    prunes every trial; an exception in ``catch`` fails every trial and the study goes on;
    running out of device memory fails every trial and, with ``on_oom="retry"``, re-queues
    each trial's parameters to run unfused (a batch of one); any other exception fails every
    trial and propagates from ``optimize`` (Optuna's semantics). A result that is not a
    sequence of ``len(trials)`` entries fails every trial, with a reason naming both lengths.

    :class:`waterwave_hpo.RayExecutor` takes ``fuse=K`` too. Under Ray Tune,
    ``waterwave_hpo.tune_hosts(fuse=K)`` calls a batched trainable with a list of up to K
    ``TuneBatchTrial`` (``waterwave_hpo.integrations.ray_tune``), one per Tune trial, each with
    its ``config``, ``report``, ``get_checkpoint`` and ``stopped``.

    >>> import optuna
    >>> import waterwave_hpo as ww
    >>> optuna.logging.set_verbosity(optuna.logging.WARNING)
    >>> @ww.batched
    ... def objective(trials):
    ...     return [t.suggest_float("x", -1, 1) ** 2 for t in trials]
    >>> study = optuna.create_study()
    >>> ww.WaterwaveExecutor("cpu", trials_per_device=1, fuse=4).optimize(
    ...     study, objective, n_trials=6
    ... )
    >>> len(study.trials), {t.state.name for t in study.trials}
    (6, {'COMPLETE'})

    Args:
        func: A function taking ``trials: list[optuna.trial.Trial]`` (1 to K of them) and
            returning a sequence of ``len(trials)`` entries as above.

    Returns:
        The marked objective; calling it calls ``func``.

    Raises:
        TypeError: If ``func`` is not callable.
    """
    if not callable(func):
        raise _checks.type_error(
            "func", func, "callable", "pass a function taking a list of optuna trials"
        )
    if isinstance(func, BatchedObjective):
        return func
    return BatchedObjective(func)


def is_batched(func: object) -> bool:
    """Whether ``func`` was marked by :func:`batched`."""
    return isinstance(func, BatchedObjective)


def check_fuse_matches(
    func: object, fuse: int | None, *, name: str, kind: str, setting: str, noun: str
) -> None:
    """Refuse a batched callable without ``fuse=K``, and ``fuse=K`` with a per-trial callable.

    Args:
        func: The objective (or Tune trainable) about to run.
        fuse: The executor's ``fuse`` setting (``None``: one trial per call).
        name: The argument ``func`` was passed as (``"func"``, ``"trainable"``).
        kind: What ``func`` is called in messages (``"objective"``, ``"trainable"``).
        setting: How a user sets ``fuse`` there (``"WaterwaveExecutor(fuse=K)"``).
        noun: What one call runs per item (``"trials"``, ``"Tune trials"``).

    Raises:
        ValueError: ``func`` is batched (:func:`batched`) and ``fuse`` is ``None``.
        TypeError: ``fuse`` is set and ``func`` takes one trial.
    """
    if is_batched(func) and fuse is None:
        raise _checks.value_error(
            "fuse",
            fuse,
            f"must be set, since {name} {func!r} is a batched {kind} (it takes a list of trials)",
            f"pass {setting} to run up to K {noun} per call, or drop waterwave_hpo.batched to "
            "run one trial per call",
        )
    if fuse is not None and not is_batched(func):
        single = setting.replace("=K", "=None")
        raise _checks.type_error(
            name,
            func,
            f"a batched {kind}, since fuse={fuse} runs up to {fuse} {noun} per call",
            f"mark a function taking a list of trials with waterwave_hpo.batched({name}), or "
            f"pass {single} for a {kind} taking one trial",
        )
