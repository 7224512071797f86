"""SGD's and Adam's update for K models at once: torch's foreach rules on the models' slices.

torch's foreach optimizers (``_multi_tensor_sgd``, ``_multi_tensor_adam`` in ``torch.optim``)
update a list of parameters with a few ``torch._foreach_*`` operations, each over the whole
list, taking one Python number per tensor where the numbers differ (a *scalar list*: Adam's
step sizes, one per parameter's step count). Here the list holds every model's slice of every
stacked parameter (``p[k]`` for each parameter ``p`` of shape ``(K, *shape)`` and each model
``k``) and the scalar lists hold model k's own hyperparameters at its slices. A step is then a
fixed number of operations, whatever the number of parameters and K (HFTA's fused optimizers,
Wang et al., MLSys 2021, arXiv:2102.02344, with per-model values), and model k's slices go
through the arithmetic the stock foreach code runs for model k alone, with one difference:
``x + a * y`` with a value ``a`` that differs between the models (the learning rate, often)
is a multiply and an add (two roundings) where the stock code adds with ``alpha=a`` (one).

Each function takes lists of equal length, one entry per slice, and ``models``, the model of
each slice; values are per model (``values[k]``). Nothing here reads a device tensor on the
host: every number comes from the host.

On a GPU one foreach operation over tensors of one dtype and device launches a kernel per
group of tensors (``multi_tensor_apply``: tens of tensors or more per launch, by the number
of lists and the CUDA version), not one per tensor; over the K*N slices of N parameters that
is a few launches, where the stacked parameters' own updates took one launch per parameter
and operation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Tensors = list[torch.Tensor]


def at(values: Sequence[float], models: Sequence[int]) -> list[float]:
    """The per-model ``values`` at each slice: ``[values[k] for k in models]``."""
    return [values[k] for k in models]


def _take(items: Sequence[torch.Tensor], where: Sequence[int]) -> Tensors:
    return [items[j] for j in where]


def _put(items: Tensors, where: Sequence[int], new: Sequence[torch.Tensor]) -> None:
    for j, tensor in zip(where, new, strict=True):
        items[j] = tensor


def _scalars(values: Sequence[float]) -> float | list[float]:
    """One number where all are equal (torch's Scalar overloads), else the list."""
    first = float(values[0])
    return first if all(v == first for v in values) else [float(v) for v in values]


def _mul_(xs: Tensors, values: Sequence[float]) -> None:
    """``x *= value`` per tensor: one operation."""
    torch._foreach_mul_(xs, _scalars(values))


def _add_scaled(xs: Tensors, ys: Tensors, values: Sequence[float]) -> Tensors:
    """``x + value * y`` per tensor, as new tensors: one operation if the values are equal."""
    scalar = _scalars(values)
    if isinstance(scalar, float):
        return list(torch._foreach_add(xs, ys, alpha=scalar))
    return list(torch._foreach_add(xs, torch._foreach_mul(ys, scalar)))


def _add_scaled_(xs: Tensors, ys: Tensors, values: Sequence[float]) -> None:
    """``x += value * y`` per tensor: one operation if the values are equal, else two."""
    scalar = _scalars(values)
    if isinstance(scalar, float):
        torch._foreach_add_(xs, ys, alpha=scalar)
    else:
        torch._foreach_add_(xs, torch._foreach_mul(ys, scalar))


def _direction(
    params: Tensors,
    grads: Tensors,
    models: Sequence[int],
    maximize: Sequence[bool],
    weight_decay: Sequence[float] | None,
) -> Tensors:
    """The gradients negated where a model maximizes, plus ``weight_decay * p`` (L2) if given.

    The caller's gradient tensors are never written (as in the stock optimizers).
    """
    g = list(grads)
    flip = [j for j, k in enumerate(models) if maximize[k]]
    if flip:
        _put(g, flip, torch._foreach_neg(_take(g, flip)))
    if weight_decay is not None:
        decay = [j for j, k in enumerate(models) if weight_decay[k] != 0]
        if decay:
            wd = [weight_decay[models[j]] for j in decay]
            _put(g, decay, _add_scaled(_take(g, decay), _take(params, decay), wd))
    return g


@dataclass(frozen=True)
class SGDValues:
    """SGD's hyperparameters, one entry per model (host numbers)."""

    lr: Sequence[float]
    momentum: Sequence[float]
    dampening: Sequence[float]
    weight_decay: Sequence[float]
    nesterov: Sequence[bool]
    maximize: Sequence[bool]


def sgd(
    params: Tensors,
    grads: Tensors,
    buffers: Tensors | None,
    started: list[bool],
    models: Sequence[int],
    values: SGDValues,
) -> None:
    """One ``torch.optim.SGD`` step (``_multi_tensor_sgd``) of every slice, in place.

    Args:
        params: The slices to update.
        grads: Their gradients (not written).
        buffers: Their momentum buffers, or None when no model uses momentum.
        started: Per slice, whether its momentum buffer holds a value (the stock optimizer's
            buffer exists); set here where a buffer starts (as a copy of its gradient).
        models: The model of each slice.
        values: The models' hyperparameters.
    """
    g = _direction(params, grads, models, values.maximize, values.weight_decay)
    moving = [j for j, k in enumerate(models) if values.momentum[k] != 0]
    if moving:
        assert buffers is not None
        old = [j for j in moving if started[j]]
        new = [j for j in moving if not started[j]]
        if old:
            bufs = _take(buffers, old)
            _mul_(bufs, [values.momentum[models[j]] for j in old])
            _add_scaled_(bufs, _take(g, old), [1 - values.dampening[models[j]] for j in old])
        if new:
            torch._foreach_copy_(_take(buffers, new), _take(g, new))
            for j in new:
                started[j] = True
        nesterov = [j for j in moving if values.nesterov[models[j]]]
        plain = [j for j in moving if not values.nesterov[models[j]]]
        if nesterov:
            momentum = [values.momentum[models[j]] for j in nesterov]
            _put(g, nesterov, _add_scaled(_take(g, nesterov), _take(buffers, nesterov), momentum))
        _put(g, plain, _take(buffers, plain))
    _add_scaled_(params, g, [-values.lr[k] for k in models])


@dataclass(frozen=True)
class AdamValues:
    """Adam's (AdamW's) hyperparameters, one entry per model (host numbers)."""

    lr: Sequence[float]
    beta1: Sequence[float]
    beta2: Sequence[float]
    eps: Sequence[float]
    weight_decay: Sequence[float]
    amsgrad: Sequence[bool]
    maximize: Sequence[bool]


def adam(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    max_exp_avg_sqs: Tensors | None,
    steps: Sequence[float],
    models: Sequence[int],
    values: AdamValues,
    *,
    decoupled: bool,
) -> None:
    """One ``torch.optim.Adam`` step (``_multi_tensor_adam``), AdamW's if ``decoupled``.

    Args:
        params: The slices to update.
        grads: Their gradients (not written).
        exp_avgs: Their first moments.
        exp_avg_sqs: Their second moments.
        max_exp_avg_sqs: Their running maxima of the second moments, or None when no model
            uses AMSGrad.
        steps: Each slice's step count after this step (1 at the first), host numbers.
        models: The model of each slice.
        values: The models' hyperparameters.
        decoupled: AdamW's decoupled weight decay (else Adam's L2 term).
    """
    v = values
    g = _direction(params, grads, models, v.maximize, None if decoupled else v.weight_decay)
    if decoupled:
        decay = [j for j, k in enumerate(models) if v.weight_decay[k] != 0]
        if decay:
            factors = [1 - v.lr[models[j]] * v.weight_decay[models[j]] for j in decay]
            _mul_(_take(params, decay), factors)
    torch._foreach_lerp_(exp_avgs, g, _scalars([1 - v.beta1[k] for k in models]))
    _mul_(exp_avg_sqs, [v.beta2[k] for k in models])
    torch._foreach_addcmul_(exp_avg_sqs, g, g, _scalars([1 - v.beta2[k] for k in models]))
    del g
    # Per slice, in Python floats from the host step counts, as the stock code does.
    step_size = [-(v.lr[k] / (1 - v.beta1[k] ** s)) for k, s in zip(models, steps, strict=True)]
    bias2_sqrt = [(1 - v.beta2[k] ** s) ** 0.5 for k, s in zip(models, steps, strict=True)]
    second = list(exp_avg_sqs)
    keeping_max = [j for j, k in enumerate(models) if v.amsgrad[k]]
    if keeping_max:
        assert max_exp_avg_sqs is not None
        maxima = _take(max_exp_avg_sqs, keeping_max)
        torch._foreach_maximum_(maxima, _take(exp_avg_sqs, keeping_max))
        _put(second, keeping_max, maxima)
    denom = torch._foreach_sqrt(second)
    torch._foreach_div_(denom, _scalars(bias2_sqrt))
    torch._foreach_add_(denom, _scalars([v.eps[k] for k in models]))
    torch._foreach_addcdiv_(params, exp_avgs, denom, _scalars(step_size))
