"""Out-of-memory re-runs that can never fit are not attempted (CPU, the scheduler's ledger).

A trial whose known need exceeds the most it could ever get (here a NodeGroup larger than the
whole ``memory_budget_bytes``) fails once, with both figures in its reason; fewer neighbours
would not help, so its parameters are not re-queued.
"""

from __future__ import annotations

from types import SimpleNamespace

import optuna
from optuna.trial import TrialState
import pytest
import torch
from torch import nn

import waterwave_hpo as ww
from waterwave_hpo.host._attempt import cannot_fit
from waterwave_hpo.scheduler import BudgetExceededError

BUDGET_BYTES = 4096  # far below one NodeGroup of the MLP below (about 2 MiB)


def _objective(trial: optuna.trial.Trial) -> float:
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    model = ww.pipeline(nn.Sequential(*layers, nn.Linear(256, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    for _ in range(2):  # the first step profiles the NodeGroups, the second is gated
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return 0.0


def test_a_trial_whose_need_exceeds_the_budget_fails_once_with_both_figures() -> None:
    executor = ww.WaterwaveExecutor(
        "cpu", trials_per_device=2, memory_budget_bytes=BUDGET_BYTES, record_trial_attrs=True
    )
    study = optuna.create_study()
    executor.optimize(study, _objective, n_trials=3)
    assert [t.state for t in study.trials] == [TrialState.FAIL] * 3  # 3 attempts, no re-run
    for trial in study.trials:
        reason = str(trial.system_attrs["waterwave:fail_reason"])
        assert "not re-run" in reason, reason
        assert "needs at least" in reason and f"({BUDGET_BYTES} bytes)" in reason, reason
        assert "waterwave:retry_of" not in trial.system_attrs


def _memory(budget_bytes: int | None, capacity_bytes: int | None) -> SimpleNamespace:
    pool = None if capacity_bytes is None else SimpleNamespace(capacity_bytes=capacity_bytes)
    return SimpleNamespace(budget_bytes=budget_bytes, pool=pool)


def _context(smallest_peak_bytes: int | None = None, batch: int = 0) -> SimpleNamespace:
    planning = SimpleNamespace(smallest_peak_bytes=smallest_peak_bytes)
    return SimpleNamespace(planning=planning, batch=tuple(range(batch)))


def _budget_error(evicted: bool) -> BaseException:
    return BudgetExceededError(3, nbytes=6000, held_bytes=1000, budget_bytes=4096, evicted=evicted)


@pytest.mark.parametrize(
    ("error", "peak_bytes", "context", "memory", "figures"),
    [
        pytest.param(
            _budget_error(False), None, _context(), _memory(4096, None), ("7000", "4096"), id="ask"
        ),
        pytest.param(
            RuntimeError("out of memory"),
            None,
            _context(smallest_peak_bytes=9000),
            _memory(4096, None),
            ("9000", "4096"),
            id="plan-floor",
        ),
        pytest.param(
            RuntimeError("out of memory"),
            2**20,
            _context(),
            _memory(None, 2**20),
            ("1048576", "capacity"),
            id="peak-at-lease",
        ),
        pytest.param(
            _budget_error(True), None, _context(), _memory(4096, None), None, id="evicted"
        ),
        pytest.param(
            _budget_error(False), None, _context(batch=2), _memory(4096, None), None, id="fused"
        ),
        pytest.param(
            RuntimeError("out of memory"), 512, _context(), _memory(4096, 2**20), None, id="fits"
        ),
    ],
)
def test_cannot_fit_compares_the_known_need_with_the_most_the_trial_could_get(
    error: BaseException,
    peak_bytes: int | None,
    context: SimpleNamespace,
    memory: SimpleNamespace,
    figures: tuple[str, str] | None,
) -> None:
    why = cannot_fit(error, peak_bytes, context, memory)  # type: ignore[arg-type]
    if figures is None:
        assert why is None
    else:
        assert why is not None and all(figure in why for figure in figures), why
