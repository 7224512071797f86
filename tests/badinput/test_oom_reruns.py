"""Out-of-memory re-runs that can never fit are not attempted (CPU, the scheduler's ledger).

A trial whose known need exceeds the most it could ever get (here a NodeGroup larger than the
whole ``memory_budget_bytes``) fails once, with both figures in its reason; fewer neighbours
would not help, so its parameters are not re-queued.
"""

from __future__ import annotations

import optuna
from optuna.trial import TrialState
import torch
from torch import nn

import waterwave_hpo as ww

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
