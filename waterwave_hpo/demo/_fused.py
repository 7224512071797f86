"""The demo's fused search (``--fuse K``): one model structure, numbers-only hyperparameters.

Each batch of up to K trials is trained as one horizontally fused model (HFTA: Wang et al.,
MLSys 2021, arXiv:2102.02344; :func:`waterwave_hpo.fusion.fuse`) with a fused SGD whose learning
rate, momentum and weight decay are per model. Every trial keeps its own ``report``, pruning
(a pruned model leaves the array, so it stops costing compute), and outcome.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
import enum
import math
from typing import TYPE_CHECKING
from typing import Any

import optuna
import torch
from torch import nn

from waterwave_hpo import _checks
from waterwave_hpo.demo._data import Digits
from waterwave_hpo.demo._model import _init_
from waterwave_hpo.executor import BatchedObjective
from waterwave_hpo.executor import batched
from waterwave_hpo.executor import current_or_none

if TYPE_CHECKING:
    from waterwave_hpo.fusion import FusedModule
    from waterwave_hpo.fusion import FusedOptimizer

BATCH_SIZE = 64
"""Training images per step, the same for every trial (a shape, so not searched)."""


class FixedModel(str, enum.Enum):
    """The one structure every trial of a fused search trains."""

    MLP = "mlp"
    """``[B, 1, 8, 8] -> [B, 10]``: flatten, 64-128-128-10, ReLU, dropout before the head."""
    CNN = "cnn"
    """``[B, 1, 8, 8] -> [B, 10]``: conv 16 (3x3) + BatchNorm + ReLU + 2x2 pool, conv 32 (3x3)
    + BatchNorm + ReLU + 2x2 pool, linear 128-64, dropout, linear 64-10."""


def build_fixed_model(
    kind: FixedModel, dropout: float, generator: torch.Generator | None = None
) -> nn.Module:
    """The fused search's model: the same structure for every trial, only ``dropout`` differs.

    Args:
        kind: Which structure.
        dropout: The dropout rate before the head, in [0, 1).
        generator: Seeds the weight initialization (torch's default scheme); ``None``: torch's
            global generator.

    Returns:
        A module mapping ``[B, 1, 8, 8]`` images to ``[B, 10]`` logits, on the CPU.
    """
    if kind is FixedModel.MLP:
        model = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64, 128),
            nn.ReLU(),
            nn.Linear(128, 128),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(128, 10),
        )
    else:
        model = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(128, 64),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(64, 10),
        )
    if generator is not None:
        _init_(model, generator)
    return model


def suggest_numbers(trial: optuna.trial.Trial) -> dict[str, float]:
    """The fused search space, numbers only: ``lr``, ``weight_decay``, ``momentum``, ``dropout``.

    Returns:
        The trial's values: ``lr`` in [1e-3, 0.3] (log), ``weight_decay`` in [1e-6, 1e-2]
        (log), ``momentum`` in [0, 0.99], ``dropout`` in [0, 0.5].
    """
    return {
        "lr": trial.suggest_float("lr", 1e-3, 0.3, log=True),
        "weight_decay": trial.suggest_float("weight_decay", 1e-6, 1e-2, log=True),
        "momentum": trial.suggest_float("momentum", 0.0, 0.99),
        "dropout": trial.suggest_float("dropout", 0.0, 0.5),
    }


def make_fused_objective(
    data: Digits, epochs: int, seed: int, model: FixedModel = FixedModel.MLP
) -> BatchedObjective[Any]:
    """A batched objective that trains its trials' models as one fused model.

    Run it with ``WaterwaveExecutor(fuse=K)``. Each trial's weights are initialized from a
    generator seeded by ``seed`` and the trial number; the models of a batch see the same
    training batches (drawn from ``seed`` and the batch's first trial number), as HFTA's
    fused array does. Dropout masks come from torch's generator (each model its own,
    ``vmap(randomness="different")``), so a trial's accuracy depends on its batch-mates'
    draws: repeatable for the same batches, not bit-for-bit across batchings.

    After every epoch each trial reports its validation accuracy; a trial the pruner prunes,
    or whose loss is not finite (it diverged: it ends FAIL, as a NaN value does), leaves the
    fused array at once. The rest go on.

    Args:
        data: The digits, on the CPU.
        epochs: Epochs per trial (>= 1).
        seed: Base seed.
        model: The one structure.

    Returns:
        ``objective(trials) -> list`` (see :func:`waterwave_hpo.batched`): per trial its last
        epoch's validation accuracy in [0, 1], an ``optuna.TrialPruned``, or NaN.

    Raises:
        ValueError: If ``epochs < 1``.
    """
    if epochs < 1:
        raise _checks.value_error("epochs", epochs, "must be >= 1", "pass e.g. epochs=10")
    from waterwave_hpo import fusion

    def objective(trials: list[optuna.trial.Trial]) -> list[object]:
        context = current_or_none()
        device = context.device if context is not None else torch.device("cpu")
        hyper = [suggest_numbers(trial) for trial in trials]
        models = [
            build_fixed_model(
                model,
                h["dropout"],
                torch.Generator().manual_seed(seed * 1_000_003 + trial.number),
            )
            for trial, h in zip(trials, hyper, strict=True)
        ]
        fused = fusion.fuse(models).to(device)
        optimizer = fusion.optimizer(
            torch.optim.SGD,
            fused,
            [
                {"lr": h["lr"], "momentum": h["momentum"], "weight_decay": h["weight_decay"]}
                for h in hyper
            ],
        )
        order_generator = torch.Generator().manual_seed(seed * 7919 + trials[0].number)
        return train_fused_batch(
            trials, fused, optimizer, data.to(device), epochs, order_generator, BATCH_SIZE
        )

    return batched(objective)


def train_fused_batch(
    trials: Sequence[optuna.trial.Trial],
    fused: FusedModule,
    optimizer: FusedOptimizer,
    data: Digits,
    epochs: int,
    order_generator: torch.Generator,
    batch_size: int,
) -> list[object]:
    """Train a fused batch's models for ``epochs``; each trial reports, prunes and ends alone.

    Every epoch the K models see the training images in one order (HFTA's shared input) drawn
    from ``order_generator``, ``batch_size`` at a time; then each trial reports its validation
    accuracy. A trial the pruner prunes, or whose loss is not finite (it diverged: it ends FAIL,
    as a NaN value does), leaves the fused array at once; the rest go on.

    Args:
        trials: The batch's trials, model ``k`` of ``fused`` being ``trials[k]``'s.
        fused: The K models as one.
        optimizer: Its fused optimizer.
        data: The digits, on the fused model's device.
        epochs: Epochs (>= 1).
        order_generator: Draws the order of the training images each epoch.
        batch_size: Training images per step.

    Returns:
        Per trial its last epoch's validation accuracy in [0, 1], an ``optuna.TrialPruned``,
        or NaN (see :func:`waterwave_hpo.batched`).
    """
    device = data.x_train.device
    loss_fn = nn.CrossEntropyLoss()
    alive = list(range(len(trials)))  # positions in `trials` of the models in the array
    entries: list[object] = [math.nan] * len(trials)
    n_train = int(data.x_train.shape[0])
    for epoch in range(epochs):
        order = torch.randperm(n_train, generator=order_generator).to(device)
        finite = _train_epoch(fused, optimizer, data, order, loss_fn, batch_size)
        accuracies = _accuracies(fused, data.x_val, data.y_val)
        keep: list[int] = []
        for position, index in enumerate(alive):
            trial = trials[index]
            if not bool(finite[position]):
                entries[index] = math.nan  # diverged: FAIL, this trial alone
                continue
            accuracy = accuracies[position]
            trial.report(accuracy, epoch)
            entries[index] = accuracy
            if trial.should_prune():
                entries[index] = optuna.TrialPruned(
                    f"pruned after epoch {epoch} at accuracy {accuracy:.4f}"
                )
                continue
            keep.append(position)
        if len(keep) < len(alive):
            if not keep:
                break
            fused.keep_models(keep)
            optimizer.keep_models(keep)
            alive = [alive[position] for position in keep]
    return entries


def _train_epoch(
    fused: FusedModule,
    optimizer: torch.optim.Optimizer,
    data: Digits,
    order: torch.Tensor,
    loss_fn: nn.Module,
    batch_size: int,
) -> torch.Tensor:
    """One epoch of the fused model over ``data`` in ``order``; which models stayed finite.

    Returns:
        ``(K,)`` bool: whether each model's loss was finite at every step.
    """
    from waterwave_hpo import fusion

    fused.train()
    finite: torch.Tensor = torch.ones(fused.num_models, dtype=torch.bool, device=order.device)
    for start in range(0, order.shape[0], batch_size):
        batch = order[start : start + batch_size]
        optimizer.zero_grad(set_to_none=True)
        losses = fusion.per_model_loss(
            loss_fn, fused(data.x_train[batch]), data.y_train[batch], target_stacked=False
        )
        finite = finite & torch.isfinite(losses.detach())
        losses.sum().backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    return finite


def _accuracies(fused: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Each model's accuracy on ``x`` (``[N, 1, 8, 8]``) against ``y`` (``[N]``)."""
    fused.eval()
    with torch.no_grad():
        predictions = fused(x).argmax(dim=-1)  # (K, N)
    return [float(v) for v in (predictions == y).float().mean(dim=1).tolist()]


def make_unfused_objective(
    data: Digits, epochs: int, seed: int, model: FixedModel = FixedModel.MLP
) -> Callable[[optuna.trial.Trial], float]:
    """The same search as :func:`make_fused_objective`, one trial at a time: its baseline.

    The same structure, search space (:func:`suggest_numbers`), initialization (seeded by
    ``seed`` and the trial number), batch size, pruning and values; the stock
    ``torch.optim.SGD``; the batch order drawn from ``seed`` and the trial's own number.

    Returns:
        ``objective(trial) -> float``: the last epoch's validation accuracy (NaN if the loss
        was not finite); raises ``optuna.TrialPruned`` when the pruner says so.

    Raises:
        ValueError: If ``epochs < 1``.
    """
    if epochs < 1:
        raise _checks.value_error("epochs", epochs, "must be >= 1", "pass e.g. epochs=10")

    def objective(trial: optuna.trial.Trial) -> float:
        context = current_or_none()
        device = context.device if context is not None else torch.device("cpu")
        h = suggest_numbers(trial)
        net = build_fixed_model(
            model, h["dropout"], torch.Generator().manual_seed(seed * 1_000_003 + trial.number)
        ).to(device)
        optimizer = torch.optim.SGD(
            net.parameters(), lr=h["lr"], momentum=h["momentum"], weight_decay=h["weight_decay"]
        )
        on_device = data.to(device)
        order_generator = torch.Generator().manual_seed(seed * 7919 + trial.number)
        loss_fn = nn.CrossEntropyLoss()
        n_train = on_device.x_train.shape[0]
        accuracy = math.nan
        for epoch in range(epochs):
            net.train()
            order = torch.randperm(n_train, generator=order_generator).to(device)
            finite = True
            for start in range(0, n_train, BATCH_SIZE):
                batch = order[start : start + BATCH_SIZE]
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(net(on_device.x_train[batch]), on_device.y_train[batch])
                finite = finite and bool(torch.isfinite(loss.detach()))
                loss.backward()
                optimizer.step()
            if not finite:
                return math.nan
            net.eval()
            with torch.no_grad():
                predictions = net(on_device.x_val).argmax(dim=-1)
            accuracy = float((predictions == on_device.y_val).float().mean())
            trial.report(accuracy, epoch)
            if trial.should_prune():
                raise optuna.TrialPruned(f"pruned after epoch {epoch} at accuracy {accuracy:.4f}")
        return accuracy

    return objective
