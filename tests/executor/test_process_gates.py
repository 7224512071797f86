"""NodeGroup gates inside worker processes (isolation="process"): each worker's own scheduler."""

from __future__ import annotations

import optuna
from optuna.trial import TrialState
import torch
from torch import nn

import waterwave_hpo as ww


def _mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(256, 10))


def _gated_objective(trial: optuna.trial.Trial) -> float:
    context = ww.current()
    torch.manual_seed(trial.number)
    model = ww.pipeline(_mlp().to(context.device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    loss = torch.tensor(0.0)
    for _ in range(3):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    stats = context.scheduler.stats()
    trial.set_user_attr("budget", context.scheduler.budget_bytes)
    trial.set_user_attr("gated_trials", sorted(t.trial_number for t in stats.trials))
    trial.set_user_attr("peak", stats.peak_bytes)
    return float(loss.item())


def test_gated_trials_reserve_in_their_workers_scheduler_within_its_share() -> None:
    budget = 64 << 20
    executor = ww.WaterwaveExecutor(
        "cpu", trials_per_device=2, isolation="process", memory_budget_bytes=budget
    )
    study = optuna.create_study()
    executor.optimize(study, _gated_objective, n_trials=4)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4
    for t in study.trials:
        # The worker's scheduler has its slot's share, and this trial's gates reserved in it.
        assert t.user_attrs["budget"] == budget // 2
        assert t.number in t.user_attrs["gated_trials"]
        assert 0 < t.user_attrs["peak"] <= budget // 2
