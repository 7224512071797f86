"""One search of the demo's NAS + HPO space under one method and seed, on its own clock."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
import os
import time
from typing import TYPE_CHECKING
from typing import Any

import optuna
import torch

from waterwave_hpo.bench._runners import _install_pool
from waterwave_hpo.bench._search_budget import DeadlinePruner
from waterwave_hpo.bench._search_methods import SearchMethod
from waterwave_hpo.bench._search_results import SearchRun
from waterwave_hpo.bench._search_results import TrialOutcome

if TYPE_CHECKING:
    from waterwave_hpo.demo import Digits


@dataclass(frozen=True)
class SearchSettings:
    """What every search of one bench shares (sent to a child process on CUDA).

    Attributes:
        device: ``cpu`` or ``cuda:N``.
        k: Trials at once for the concurrent methods; trials per fused model for ``fused``.
        trials: The trial budget: a search stops asking after this many trials.
        epochs: Training epochs per trial (the demo's objective).
        budget_s: The time budget of one search, seconds.
    """

    device: str
    k: int
    trials: int
    epochs: int
    budget_s: float


def run_search(method: SearchMethod, seed: int, settings: SearchSettings) -> SearchRun:
    """Run the demo's search under ``method`` with ``seed`` and report its trials.

    The study is the demo's (:func:`waterwave_hpo.demo.demo_sampler`: TPE seeded with ``seed``,
    constant liar for the concurrent methods; :func:`waterwave_hpo.demo.demo_pruner`, wrapped
    in a :class:`DeadlinePruner`), in memory. The clock starts at the first ask, after the
    executor (and its workers) started; it stops asking at ``settings.budget_s`` or after
    ``settings.trials`` trials. On the CPU the concurrent methods give each trial
    ``1/K`` of torch's threads (at least one), as the demo does; fused and one at a time keep
    them all.

    Returns:
        The search's trials on its clock; ``available=False`` with the reason when the method
        could not start on this machine (the executor refused its settings).
    """
    run = SearchRun(
        method.value, seed, 1 if method is SearchMethod.TEMPORAL else settings.k, settings.budget_s
    )
    default_threads = torch.get_num_threads()
    threads = max(1, default_threads // settings.k) if method.shares_cores else default_threads
    run.torch_threads = threads
    torch.set_num_threads(threads)
    # The demo's package imports the executor and scikit-learn: here, not when the command
    # line builds its parser.
    from waterwave_hpo import demo

    executor: Any = None
    device = torch.device(settings.device)
    try:
        data = demo.load_digits()
        started = time.time()
        try:
            if device.type == "cuda" and method in _POOLED:
                # Before anything touches CUDA: PyTorch cannot swap an initialised allocator.
                _install_pool(device)
            executor, sampler, objective = _prepare(method, seed, settings, data)
        except (ValueError, RuntimeError, OSError) as error:
            run.available = False
            run.skipped_reason = f"{type(error).__name__}: {error}"
            return run
        run.startup_s = time.time() - started
        if method is not SearchMethod.EXECUTOR_PROCESS:  # its workers warmed up in _prepare
            warm_up(device)
        pruner = DeadlinePruner(demo.demo_pruner())
        study = optuna.create_study(direction="maximize", sampler=sampler, pruner=pruner)
        run.load_average_1min = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        clock = pruner.start(settings.budget_s)
        _optimize(method, study, objective, executor, run.k, settings, pruner.stop_study)
        run.wall_s = time.time() - clock
        run.trials = [_outcome(t, clock) for t in study.get_trials(deepcopy=False)]
    finally:
        torch.set_num_threads(default_threads)
        if executor is not None:
            executor.close()
    return run


_POOLED = (SearchMethod.EXECUTOR_THREADS, SearchMethod.FUSED)
"""The methods whose trials run in this process on the executor: on CUDA, the stream-aware pool."""


def warm_up(device: torch.device) -> None:
    """Pay torch's first-use costs in this process, so that no search's clock counts them.

    The first optimizer a process makes imports ``torch._dynamo`` (seconds on a busy CPU), the
    first convolution sets up its kernels, the first fused model imports ``torch.func``: a user
    pays these once per process, not once per trial.
    """
    from torch import nn

    from waterwave_hpo import fusion

    def model() -> nn.Module:
        layers = [nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2)]
        return nn.Sequential(*layers, nn.Flatten(), nn.Linear(64, 10)).to(device)

    x = torch.zeros(2, 1, 8, 8, device=device)
    for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        net = model()
        optimizer = cls(net.parameters(), lr=1e-3)
        net(x).sum().backward()
        optimizer.step()
    fused = fusion.fuse([model(), model()])
    fused_optimizer = fusion.optimizer(torch.optim.SGD, fused, [{"lr": 1e-3}] * 2)
    fused(x).sum().backward()
    fused_optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prepare(
    method: SearchMethod, seed: int, settings: SearchSettings, data: Digits
) -> tuple[Any, optuna.samplers.BaseSampler, Callable[..., Any]]:
    """The method's executor (``None`` for Optuna's own loop), sampler and objective.

    With ``isolation="process"`` the workers are started here (one throwaway study of K
    trivial trials), so the search's clock does not count them; the run reports the time.

    Raises:
        ValueError: The executor refused the settings on this machine (e.g. not enough host
            memory for K worker processes).
    """
    from waterwave_hpo import demo
    from waterwave_hpo.executor import WaterwaveExecutor

    sampler: optuna.samplers.BaseSampler = demo.demo_sampler(seed, constant_liar=method.concurrent)
    objective: Callable[..., Any]
    if method is SearchMethod.FUSED:
        pinning = demo.nas_pinning_sampler(sampler)
        objective = demo.make_fused_nas_objective(data, settings.epochs, seed, pinning)
        executor = WaterwaveExecutor(devices=settings.device, trials_per_device=1, fuse=settings.k)
        return executor, pinning, objective
    objective = demo.make_objective(data, settings.epochs, seed, device=settings.device)
    if method in (SearchMethod.TEMPORAL, SearchMethod.OPTUNA_THREADS):
        return None, sampler, objective
    isolation = "process" if method is SearchMethod.EXECUTOR_PROCESS else "threads"
    executor = WaterwaveExecutor(
        devices=settings.device, trials_per_device=settings.k, isolation=isolation
    )
    if method is SearchMethod.EXECUTOR_PROCESS:
        warm = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
        executor.optimize(warm, _warm_worker, n_trials=settings.k)
    return executor, sampler, objective


def _warm_worker(trial: optuna.trial.Trial) -> float:
    """A trial that warms its worker process up (:func:`warm_up`), before the search's clock."""
    from waterwave_hpo.executor import current

    warm_up(current().device)
    return 0.0


def _optimize(
    method: SearchMethod,
    study: optuna.Study,
    objective: Callable[..., Any],
    executor: Any,
    k: int,
    settings: SearchSettings,
    stop: Callable[[optuna.Study, optuna.trial.FrozenTrial], None],
) -> None:
    # catch: a trial that raises fails alone, as the demo's would; the study goes on.
    options: dict[str, Any] = dict(
        n_trials=settings.trials, timeout=settings.budget_s, catch=(Exception,), callbacks=[stop]
    )
    if executor is None:
        study.optimize(objective, n_jobs=k, **options)
    else:
        executor.optimize(study, objective, **options)


def _outcome(trial: optuna.trial.FrozenTrial, clock: float) -> TrialOutcome:
    start = trial.datetime_start
    end = trial.datetime_complete
    return TrialOutcome(
        number=trial.number,
        state=trial.state.name,
        value=trial.value if trial.state is optuna.trial.TrialState.COMPLETE else None,
        start_s=None if start is None else start.timestamp() - clock,
        end_s=None if end is None else end.timestamp() - clock,
        params=dict(trial.params),
    )
