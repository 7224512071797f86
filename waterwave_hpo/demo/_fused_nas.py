"""The demo's NAS + HPO search, fused: the trials of a batch share its first trial's structure."""

from __future__ import annotations

from typing import Any

import optuna
import torch
from torch import nn

from waterwave_hpo import _checks
from waterwave_hpo.demo._data import Digits
from waterwave_hpo.demo._fused import train_fused_batch
from waterwave_hpo.demo._model import SeededDropout
from waterwave_hpo.demo._model import build_model
from waterwave_hpo.demo._model import suggest_batch_size
from waterwave_hpo.demo._model import suggest_optimizer
from waterwave_hpo.demo._pinning import StructurePinningSampler
from waterwave_hpo.executor import BatchedObjective
from waterwave_hpo.executor import batched
from waterwave_hpo.executor import current_or_none

PER_MODEL_PARAMS = ("lr", "dropout")
"""The demo's parameters that may differ between the models of one fused batch."""


def nas_pinning_sampler(base: optuna.samplers.BaseSampler) -> StructurePinningSampler:
    """``base`` wrapped so that a fused batch of the NAS search shares one structure.

    Every parameter of the demo's NAS search but :data:`PER_MODEL_PARAMS` is pinned to the
    batch's first trial's value: the architecture (``n_conv``, ``channels_i``, ``kernel_i``,
    ``hidden``), the optimizer class and the batch size.
    """
    return StructurePinningSampler(base, free=PER_MODEL_PARAMS)


def make_fused_nas_objective(
    data: Digits, epochs: int, seed: int, sampler: StructurePinningSampler
) -> BatchedObjective[Any]:
    """A batched objective for the demo's NAS search: each batch trained as one fused model.

    Run it with ``WaterwaveExecutor(fuse=K)`` on a study whose sampler is ``sampler``
    (:func:`nas_pinning_sampler`). The batch's first trial samples the whole NAS + HPO space
    (:func:`waterwave_hpo.demo.build_model`, its optimizer and batch size); every other trial
    of the batch takes its architecture, optimizer and batch size and samples only its own
    learning rate and dropout rate; the K models then train as one fused model
    (:func:`waterwave_hpo.fusion.fuse`, a fused optimizer with a learning rate per model). As
    in :func:`make_objective`, each model's weights are initialized from ``seed`` and its
    trial's number, each trial reports its validation accuracy every epoch and is pruned
    alone. Unlike it, the models of a batch see one order of training images (drawn from
    ``seed`` and the batch's first trial number, as HFTA's fused array does) and their dropout
    masks come from torch's generator (``nn.Dropout`` per model, not the seeded
    :class:`SeededDropout`, whose per-trial seed would make the structures differ).

    Args:
        data: The digits, on the CPU.
        epochs: Epochs per trial (>= 1).
        seed: Base seed.
        sampler: The study's sampler.

    Returns:
        ``objective(trials) -> list``: per trial its last epoch's validation accuracy, an
        ``optuna.TrialPruned``, or NaN (diverged).

    Raises:
        ValueError: If ``epochs < 1``; when called, if the study's sampler is not ``sampler``
            (the batch could not share a structure).
    """
    if epochs < 1:
        raise _checks.value_error("epochs", epochs, "must be >= 1", "pass e.g. epochs=5")
    from waterwave_hpo import fusion

    def objective(trials: list[optuna.trial.Trial]) -> list[object]:
        if trials[0].study.sampler is not sampler:
            raise ValueError(
                f"sampler={sampler!r} is not the study's sampler "
                f"({trials[0].study.sampler!r}), so the trials of a batch cannot share one "
                "structure; create the study with sampler=sampler."
            )
        context = current_or_none()
        device = context.device if context is not None else torch.device("cpu")
        leader = trials[0]
        models: list[nn.Module] = []
        arguments: list[dict[str, float]] = []
        classes: set[type[torch.optim.Optimizer]] = set()
        batch_sizes: set[int] = set()
        for position, trial in enumerate(trials):
            if position:
                sampler.follow(trial.number, leader.params)
            generator = torch.Generator().manual_seed(seed * 1_000_003 + trial.number)
            models.append(_plain_dropout(build_model(trial, generator=generator)))
            cls, trial_arguments = suggest_optimizer(trial)
            classes.add(cls)
            arguments.append(trial_arguments)
            batch_sizes.add(suggest_batch_size(trial))
        (cls,) = classes  # pinned: one class, one batch size per batch
        (batch_size,) = batch_sizes
        fused = fusion.fuse(models).to(device)
        optimizer = fusion.optimizer(cls, fused, arguments)
        order_generator = torch.Generator().manual_seed(seed * 7919 + leader.number)
        return train_fused_batch(
            trials, fused, optimizer, data.to(device), epochs, order_generator, batch_size
        )

    return batched(objective)


def _plain_dropout(model: nn.Module) -> nn.Module:
    """``model`` with each :class:`SeededDropout` child replaced by ``nn.Dropout`` of its rate."""
    for name, child in model.named_children():
        if isinstance(child, SeededDropout):
            setattr(model, name, nn.Dropout(child.p))
    return model
