"""The loss of each fused model, so one backward gives each model its own gradient."""

from __future__ import annotations

from collections.abc import Callable

import torch

from waterwave_hpo._checks import type_error
from waterwave_hpo._checks import value_error


def per_model_loss(
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    outputs: torch.Tensor,
    target: torch.Tensor,
    *,
    target_stacked: bool | None = None,
) -> torch.Tensor:
    """The loss of each of the K fused models, shape ``(K,)``.

    ``loss_fn`` is called once per model on that model's outputs ``(B, ...)`` and its target
    (so each loss is computed exactly as for the model alone), and must return a scalar
    (e.g. ``nn.CrossEntropyLoss()`` or ``F.mse_loss`` with a mean or sum reduction). The
    models share no parameter, so ``per_model_loss(...).sum().backward()`` gives each model
    exactly the gradient of its own loss, as if it were trained alone (HFTA, MLSys 2021: the
    array's loss is the sum).

    Args:
        loss_fn: ``loss_fn(output, target) -> scalar`` for one model.
        outputs: The fused module's outputs, ``(K, B, ...)``.
        target: One target for every model, ``(B, ...)``, or one per model, ``(K, B, ...)``.
        target_stacked: Whether ``target`` holds one target per model. None: stacked iff
            ``target.shape[:2] == outputs.shape[:2]`` and it cannot be a shared target (an
            error asks for this argument when both readings fit).

    Returns:
        The K losses, ``(K,)``.

    Raises:
        TypeError: ``loss_fn`` is not callable, or ``outputs``/``target`` is not a tensor.
        ValueError: ``outputs`` has no model dimension, a stacked ``target`` does not start
            with K, the target's reading is ambiguous, or ``loss_fn`` does not return a scalar.

    >>> import torch
    >>> import torch.nn.functional as F
    >>> outputs = torch.zeros(3, 4, 2)
    >>> per_model_loss(F.cross_entropy, outputs, torch.tensor([0, 1, 0, 1]))
    tensor([0.6931, 0.6931, 0.6931])
    """
    if not callable(loss_fn):
        raise type_error("loss_fn", loss_fn, "callable", "pass e.g. nn.CrossEntropyLoss()")
    if not isinstance(outputs, torch.Tensor):
        raise type_error("outputs", outputs, "a tensor", "pass the fused module's outputs")
    if not isinstance(target, torch.Tensor):
        raise type_error("target", target, "a tensor", "pass (B, ...) or (K, B, ...) targets")
    if outputs.dim() < 1:
        raise value_error(
            "outputs.shape",
            tuple(outputs.shape),
            "has no model dimension",
            "pass the fused module's outputs, (K, B, ...)",
        )
    k = outputs.shape[0]
    if target_stacked is None:
        looks_stacked = target.dim() >= 2 and target.shape[:2] == outputs.shape[:2]
        could_be_shared = target.dim() < outputs.dim() and target.shape[0] == outputs.shape[1]
        if looks_stacked and could_be_shared:
            raise value_error(
                "target.shape",
                tuple(target.shape),
                f"reads as one target per model and as one shared target (K=B={k})",
                "pass target_stacked=True or False",
            )
        target_stacked = looks_stacked
    if target_stacked and (target.dim() == 0 or target.shape[0] != k):
        raise value_error(
            "target.shape",
            tuple(target.shape),
            f"must start with K={k} when target_stacked=True",
            "pass one target per model, (K, B, ...), or a shared one, (B, ...)",
        )
    # One call per model on its own slice: exactly the loss it would have alone, and on this
    # CPU faster than a vmap of the loss (experiments/results/2026-11-23-fusion-kernels).
    # unbind() keeps backward to one node that stacks the K gradients.
    targets = target.unbind(0) if target_stacked else [target] * k
    losses = []
    for output, model_target in zip(outputs.unbind(0), targets, strict=True):
        try:
            loss = loss_fn(output, model_target)
        except (RuntimeError, ValueError) as error:  # torch's shape errors name no argument
            raise value_error(
                "target.shape",
                tuple(target.shape),
                f"does not fit outputs of shape {tuple(outputs.shape)} (K={k}) in loss_fn "
                f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})",
                "pass one target per model, (K, B, ...), or a shared one, (B, ...), of the "
                "shape loss_fn takes for one model's (B, ...) outputs",
            ) from error
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else loss
            raise value_error(
                "loss_fn",
                loss_fn,
                f"must return a scalar per model, got {shape} for K={k}",
                "use a loss with reduction='mean' or 'sum'",
            )
        losses.append(loss)
    return torch.stack(losses)
