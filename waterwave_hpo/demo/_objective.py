"""The demo's objective: train the trial's CNN for a few epochs, report validation accuracy."""

from __future__ import annotations

from collections.abc import Callable

import optuna
import torch
from torch import nn

from waterwave_hpo import _checks
from waterwave_hpo.demo._data import Digits
from waterwave_hpo.demo._model import build_model
from waterwave_hpo.demo._model import build_optimizer
from waterwave_hpo.demo._model import suggest_batch_size
from waterwave_hpo.executor import current_or_none


def make_objective(
    data: Digits, epochs: int, seed: int, device: torch.device | str | None = None
) -> Callable[[optuna.trial.Trial], float]:
    """Return an Optuna objective that trains on ``data`` and returns validation accuracy.

    The objective runs on the device :func:`waterwave_hpo.current` gives it (``device`` when it
    is called outside the executor, e.g. by Optuna's own ``study.optimize``), reports accuracy
    after every epoch and raises ``optuna.TrialPruned`` when the study's pruner says so. The
    trial's torch generator is seeded from ``seed`` and the trial number; it draws the
    initialization, the order of training batches and the dropout masks, so a trial's training,
    given its parameters, does not depend on its co-hosted neighbours: the same seed, trial
    number and parameters give the same accuracy (on one machine, with the same number of
    intra-op threads).

    Args:
        data: The digits, on the CPU (copied to the trial's device once per trial).
        epochs: Epochs per trial (>= 1).
        seed: Base seed.
        device: The device outside the executor; ``None``: the CPU.

    Returns:
        ``objective(trial) -> float``, the last epoch's validation accuracy in [0, 1].
    """
    if epochs < 1:
        raise _checks.value_error("epochs", epochs, "must be >= 1", "pass e.g. epochs=10")
    outside = torch.device("cpu" if device is None else device)

    def objective(trial: optuna.trial.Trial) -> float:
        context = current_or_none()
        device = context.device if context is not None else outside
        generator = torch.Generator().manual_seed(seed * 1_000_003 + trial.number)
        model = build_model(trial, generator=generator).to(device)
        optimizer = build_optimizer(trial, list(model.parameters()))
        batch_size = suggest_batch_size(trial)
        on_device = data.to(device)
        loss_fn = nn.CrossEntropyLoss()
        n_train = on_device.x_train.shape[0]
        accuracy = 0.0
        for epoch in range(epochs):
            model.train()
            order = torch.randperm(n_train, generator=generator).to(device)
            for start in range(0, n_train, batch_size):
                batch = order[start : start + batch_size]
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(on_device.x_train[batch]), on_device.y_train[batch])
                loss.backward()
                optimizer.step()
            accuracy = _accuracy(model, on_device.x_val, on_device.y_val)
            trial.report(accuracy, epoch)
            if trial.should_prune():
                raise optuna.TrialPruned(f"pruned after epoch {epoch} at accuracy {accuracy:.4f}")
        return accuracy

    return objective


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        predictions = model(x).argmax(dim=1)
    return float((predictions == y).float().mean().item())
