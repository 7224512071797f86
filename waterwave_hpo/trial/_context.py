"""The running trial's context: which device, stream and slot a trial thread owns.

It lives below every mechanism a trial uses (NodeGroup gates, memory plans, the pool's
accounts) and above none: those read the context, the executor and the cluster's hosts set it.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING
from typing import Any

if TYPE_CHECKING:
    import optuna
    import torch


class NotInTrialError(RuntimeError):
    """Raised by :func:`current` when no trial run by a ``WaterwaveExecutor`` is running."""


class NoOptunaTrial:
    """The ``trial`` of a context that runs no Optuna trial (a null object, not ``None``).

    A Ray Tune trial co-hosted by :func:`waterwave_hpo.tune_hosts` has a :class:`TrialContext`
    (device, stream, scheduler) but no Optuna trial: its parameters are Tune's ``config``. Any
    use of this stand-in raises an :class:`AttributeError` that says so.

    Args:
        owner: Who runs the trial instead of Optuna, for the message (e.g. ``"tune_hosts()"``).
    """

    def __init__(self, owner: str) -> None:
        self._owner = owner

    def __getattr__(self, name: str) -> Any:
        """Refuse every attribute, naming the trial's owner and where its parameters are.

        Raises:
            AttributeError: Always.
        """
        raise AttributeError(
            f"trial.{name}: this trial is run by {self._owner}, not by Optuna, so it has no "
            "Optuna trial; read its parameters from the config its function receives."
        )

    def __repr__(self) -> str:
        return f"NoOptunaTrial({self._owner!r})"


@dataclass(frozen=True)
class TrialContext:
    """What a co-hosted trial owns while it runs.

    Attributes:
        trial: The Optuna trial being run; a :class:`NoOptunaTrial` for a Ray Tune trial
            co-hosted by ``tune_hosts()``.
        trial_number: ``trial.number``.
        device: The trial's device (``cuda:N`` or ``cpu``). Move the model and data there.
        stream: The trial's own CUDA stream, already current in the trial's thread;
            ``None`` on the CPU, where streams do not exist.
        slot: Index of the trial's slot on its device host, ``0 <= slot < trials_per_device``.
        attempt: ``0`` on the first run; ``k`` on the ``k``-th re-run after an out-of-memory
            error (see ``WaterwaveExecutor(on_oom="retry")``).
        scheduler: The device host's pipeline scheduler that NodeGroup gates ask for memory,
            or ``None`` when the executor runs without one.
        retry_of: On a re-run (``attempt > 0``), the number of the trial whose parameters it
            repeats; ``None`` otherwise.
        planning: The attempt's memory planning (``WaterwaveExecutor(memory_plan="home")``),
            which :func:`waterwave_hpo.fit_trial_memory` reads and fills; ``None`` without.
            Typed ``Any`` here: its type belongs to the executor, which this package lies
            below.
        batch: A fused batch's trials (``WaterwaveExecutor(fuse=K)``), ``trial`` first; empty
            for one trial.
    """

    trial: optuna.trial.Trial | NoOptunaTrial
    trial_number: int
    device: torch.device
    stream: torch.cuda.Stream | None
    slot: int
    attempt: int = 0
    scheduler: Any = None
    retry_of: int | None = None
    planning: Any = None
    batch: tuple[Any, ...] = ()


_CURRENT: ContextVar[TrialContext | None] = ContextVar("waterwave_hpo_current_trial", default=None)


def current() -> TrialContext:
    """Return the context of the trial running in this thread.

    Call it inside an objective run by :class:`~waterwave_hpo.WaterwaveExecutor`::

        def objective(trial):
            device = waterwave_hpo.current().device
            model = build(trial).to(device)

    Returns:
        The running trial's :class:`TrialContext`.

    Raises:
        NotInTrialError: If no trial is running in this thread (a notebook cell, a test, a
            thread the objective started itself, or ``study.optimize`` without
            ``executor=``). Use :func:`current_or_none` where that is expected.
    """
    context = _CURRENT.get()
    if context is None:
        raise NotInTrialError(
            "waterwave_hpo.current() was called outside a trial run by WaterwaveExecutor. "
            "Call it inside the objective passed to WaterwaveExecutor().optimize(...) or "
            "study.optimize(..., executor=WaterwaveExecutor()); outside a trial use "
            "waterwave_hpo.current_or_none(), which returns None. A thread the objective "
            "starts does not see its trial: read ww.current() in the objective and pass it on."
        )
    return context


def current_or_none() -> TrialContext | None:
    """Return the running trial's context, or ``None`` outside a trial (never raises)."""
    return _CURRENT.get()


@contextlib.contextmanager
def trial_scope(
    scheduler: Any,
    trial_number: int,
    *,
    trial: optuna.trial.Trial | None = None,
    device: torch.device | str = "cpu",
) -> Iterator[TrialContext]:
    """Run a block as trial ``trial_number`` of ``scheduler``, as the executor's slots do.

    For notebooks, tests and benchmarks that drive a
    :class:`~waterwave_hpo.scheduler.PipelineScheduler` without the executor: inside the block
    :func:`current` returns the context and NodeGroup gates reserve memory in ``scheduler``;
    on exit (normal or not) the trial is finished in the scheduler, releasing all it holds.

    Args:
        scheduler: The scheduler the gates use, or ``None`` for none.
        trial_number: The trial's number (its key in the scheduler).
        trial: The Optuna trial, if there is one (the scheduler reads its reported values).
        device: The device the block's model runs on.

    Yields:
        The :class:`TrialContext` that is current in the block.
    """
    import torch

    context = TrialContext(
        trial=trial,  # type: ignore[arg-type]
        trial_number=trial_number,
        device=torch.device(device),
        stream=None,
        slot=0,
        scheduler=scheduler,
    )
    if scheduler is not None:
        scheduler.trial_started(trial_number, trial)
    token = _CURRENT.set(context)
    try:
        yield context
    finally:
        _CURRENT.reset(token)
        if scheduler is not None:
            scheduler.trial_finished(trial_number)
