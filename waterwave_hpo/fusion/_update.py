"""SGD's and Adam's update for K models at once: torch's foreach rules, per model.

torch's foreach optimizers (``_multi_tensor_sgd``, ``_multi_tensor_adam`` in ``torch.optim``)
update a list of parameters with a few ``torch._foreach_*`` operations, each over the whole
list, taking one Python number per tensor where the numbers differ (a *scalar list*: Adam's
step sizes, one per parameter's step count). Here each operation runs over the N stacked
tensors ``(K, ...)`` where every model has the same value (betas, eps, often the momentum),
and otherwise over every model's slice of them (``p[k]`` for each of the N tensors and each
model ``k``), the scalar list holding model k's own value at its slices (the learning rate,
in a search). A step is then a fixed number of operations, whatever N and K (HFTA's fused
optimizers, Wang et al., MLSys 2021, arXiv:2102.02344, with per-model values), and model k's
slices go through the arithmetic the stock foreach code runs for model k alone, with one
difference: ``x + a * y`` with a value ``a`` that differs between the models is a multiply
and an add (two roundings) where the stock code adds with ``alpha=a`` (one).

Values are given per slice (model-minor: slice ``j`` is model ``j % K``); None leaves that
slice alone. Nothing here reads a device tensor on the host: every number comes from the host.

On a GPU one foreach operation over tensors of one dtype and device launches a kernel per
group of tensors (``multi_tensor_apply``: tens of tensors or more per launch, by the number
of lists and the CUDA version), not one per tensor: over the N stacked tensors that is about
one launch, over their K*N slices a few.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

Tensors = list[torch.Tensor]
Values = Sequence[float | None]
"""One value per slice (model-minor); None leaves the slice alone."""


class Operand:
    """N stacked tensors ``(K, ...)`` and their K*N slices, model-minor: ``[t0[0], t0[1], ...]``.

    ``whole`` is None where the slices are not the slices of N stacked tensors (an operation
    made new tensors for some models only, or per model): then only the slices are used.

    Args:
        k: K.
        whole: The N stacked tensors, or None.
        slices: The slices, or None to make them from ``whole`` when first needed.
        slicer: How a stacked tensor's K slices are made (a cache of views that persist
            across steps, for parameters and state); ``unbind(0)`` by default.
    """

    def __init__(
        self,
        k: int,
        whole: Tensors | None,
        slices: Tensors | None = None,
        slicer: Callable[[torch.Tensor], Sequence[torch.Tensor]] | None = None,
    ) -> None:
        self.k = k
        self.whole = whole
        self._slices = slices
        self._slicer = slicer

    @property
    def slices(self) -> Tensors:
        """The K*N slices (views of ``whole``, made once)."""
        if self._slices is None:
            assert self.whole is not None
            slicer = self._slicer or (lambda t: t.unbind(0))
            self._slices = [s for t in self.whole for s in slicer(t)]
        return self._slices


def _scalars(values: Sequence[float]) -> float | list[float]:
    """One number where all are equal (torch's Scalar overloads), else the list."""
    first = float(values[0])
    return first if all(v == first for v in values) else [float(v) for v in values]


def _per_tensor(values: Values, k: int) -> float | list[float] | None:
    """The value of each stacked tensor where its K slices share one, or None.

    A float where every tensor has the same, else one per tensor; None where a slice is left
    alone or the models' values differ.
    """
    per = []
    for i in range(0, len(values), k):
        block = values[i : i + k]
        first = block[0]
        if first is None or any(v != first for v in block):
            return None
        per.append(first)
    return _scalars(per)


def _active(values: Sequence[object]) -> list[int]:
    return [j for j, v in enumerate(values) if v is not None and v is not False]


def _take(items: Sequence[torch.Tensor], where: Sequence[int]) -> Tensors:
    return [items[j] for j in where]


def _scalars_at(values: Values, where: Sequence[int]) -> float | list[float]:
    picked = [values[j] for j in where]
    return _scalars([v for v in picked if v is not None])


def _inplace(fn: Callable[..., Any], values: Values, *operands: Operand) -> None:
    """``fn(*tensor_lists, scalars)`` in place, over the stacked tensors or the slices.

    Over the stacked tensors where each one's K models share a value (one scalar per tensor);
    else over the slices given a value.
    """
    whole = _per_tensor(values, operands[0].k)
    wholes = [o.whole for o in operands]
    if whole is not None and all(w is not None for w in wholes):
        fn(*wholes, whole)
        return
    where = _active(values)
    if where:
        fn(*(_take(o.slices, where) for o in operands), _scalars_at(values, where))


def _inplace_where(fn: Callable[..., Any], flags: Sequence[bool], *operands: Operand) -> None:
    """``fn(*tensor_lists)`` in place, on the slices whose flag is set (all: the stacked)."""
    wholes = [o.whole for o in operands]
    if all(flags) and all(w is not None for w in wholes):
        fn(*wholes)
        return
    where = _active(flags)
    if where:
        fn(*(_take(o.slices, where) for o in operands))


def _replaced(x: Operand, where: Sequence[int], new: Sequence[torch.Tensor]) -> Operand:
    out = list(x.slices)
    for j, tensor in zip(where, new, strict=True):
        out[j] = tensor
    return Operand(x.k, None, out)


def add_scaled_(x: Operand, y: Operand, values: Values) -> None:
    """``x += value * y`` in place: one operation where the values are equal, else two."""
    whole = _per_tensor(values, x.k)
    if isinstance(whole, float) and x.whole is not None and y.whole is not None:
        torch._foreach_add_(x.whole, y.whole, alpha=whole)
        return
    where = _active(values)
    if not where:
        return
    xs, ys, scalars = _take(x.slices, where), _take(y.slices, where), _scalars_at(values, where)
    if isinstance(scalars, float):
        torch._foreach_add_(xs, ys, alpha=scalars)
    else:
        torch._foreach_add_(xs, torch._foreach_mul(ys, scalars))


def add_scaled(x: Operand, y: Operand, values: Values) -> Operand:
    """``x + value * y`` as new tensors where a value is given (``x``'s slices elsewhere)."""
    whole = _per_tensor(values, x.k)
    if isinstance(whole, float) and x.whole is not None and y.whole is not None:
        return Operand(x.k, list(torch._foreach_add(x.whole, y.whole, alpha=whole)))
    where = _active(values)
    if not where:
        return x
    xs, ys, scalars = _take(x.slices, where), _take(y.slices, where), _scalars_at(values, where)
    if isinstance(scalars, float):
        new = torch._foreach_add(xs, ys, alpha=scalars)
    else:
        new = torch._foreach_add(xs, torch._foreach_mul(ys, scalars))
    return _replaced(x, where, new)


def negated(x: Operand, flags: Sequence[bool]) -> Operand:
    """``-x`` as new tensors where the flag is set (``x``'s slices elsewhere)."""
    if all(flags) and x.whole is not None:
        return Operand(x.k, list(torch._foreach_neg(x.whole)))
    where = _active(flags)
    if not where:
        return x
    return _replaced(x, where, torch._foreach_neg(_take(x.slices, where)))


def chosen(flags: Sequence[bool], a: Operand, b: Operand) -> Operand:
    """``a``'s slices where the flag is set, ``b``'s elsewhere (no operation)."""
    if all(flags):
        return a
    if not any(flags):
        return b
    picked = [x if f else y for f, x, y in zip(flags, a.slices, b.slices, strict=True)]
    return Operand(a.k, None, picked)


def square_root(x: Operand) -> Operand:
    """``sqrt(x)`` as new tensors."""
    if x.whole is not None:
        return Operand(x.k, list(torch._foreach_sqrt(x.whole)))
    return Operand(x.k, None, list(torch._foreach_sqrt(x.slices)))


def _direction(
    params: Operand,
    grads: Operand,
    models: Sequence[int],
    maximize: Sequence[bool],
    weight_decay: Sequence[float] | None,
) -> Operand:
    """The gradients negated where a model maximizes, plus ``weight_decay * p`` (L2) if given.

    The caller's gradient tensors are never written (as in the stock optimizers).
    """
    g = negated(grads, [maximize[m] for m in models])
    if weight_decay is not None:
        g = add_scaled(g, params, [weight_decay[m] or None for m in models])
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
    params: Operand,
    grads: Operand,
    buffers: Operand | None,
    started: list[bool],
    values: SGDValues,
) -> None:
    """One ``torch.optim.SGD`` step (``_multi_tensor_sgd``) of every model, in place.

    Args:
        params: The stacked parameters to update.
        grads: Their gradients (not written).
        buffers: Their momentum buffers, or None when no model uses momentum.
        started: Per slice, whether its momentum buffer holds a value (the stock optimizer's
            buffer exists); set here where a buffer starts (as a copy of its gradient).
        values: The models' hyperparameters.
    """
    assert params.whole is not None
    v = values
    models = list(range(params.k)) * len(params.whole)
    g = _direction(params, grads, models, v.maximize, v.weight_decay)
    moving = [v.momentum[m] != 0 for m in models]
    if any(moving):
        assert buffers is not None
        old = [mv and st for mv, st in zip(moving, started, strict=True)]
        new = [mv and not st for mv, st in zip(moving, started, strict=True)]
        _inplace(
            torch._foreach_mul_,
            [v.momentum[m] if o else None for m, o in zip(models, old, strict=True)],
            buffers,
        )
        add_scaled_(
            buffers,
            g,
            [1 - v.dampening[m] if o else None for m, o in zip(models, old, strict=True)],
        )
        _inplace_where(torch._foreach_copy_, new, buffers, g)
        for j in _active(new):
            started[j] = True
        nesterov = [mv and v.nesterov[m] for m, mv in zip(models, moving, strict=True)]
        ahead = add_scaled(
            g,
            buffers,
            [v.momentum[m] if n else None for m, n in zip(models, nesterov, strict=True)],
        )
        plain = [mv and not n for mv, n in zip(moving, nesterov, strict=True)]
        g = chosen(plain, buffers, ahead)
    add_scaled_(params, g, [-v.lr[m] for m in models])


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
    params: Operand,
    grads: Operand,
    exp_avgs: Operand,
    exp_avg_sqs: Operand,
    max_exp_avg_sqs: Operand | None,
    steps: Sequence[float],
    values: AdamValues,
    *,
    decoupled: bool,
) -> None:
    """One ``torch.optim.Adam`` step (``_multi_tensor_adam``), AdamW's if ``decoupled``.

    Args:
        params: The stacked parameters to update.
        grads: Their gradients (not written).
        exp_avgs: Their first moments.
        exp_avg_sqs: Their second moments.
        max_exp_avg_sqs: Their running maxima of the second moments, or None when no model
            uses AMSGrad.
        steps: Each slice's step count after this step (1 at the first), host numbers.
        values: The models' hyperparameters.
        decoupled: AdamW's decoupled weight decay (else Adam's L2 term).
    """
    assert params.whole is not None
    v = values
    models = list(range(params.k)) * len(params.whole)
    g = _direction(params, grads, models, v.maximize, None if decoupled else v.weight_decay)
    if decoupled:
        decay = [
            1 - v.lr[m] * v.weight_decay[m] if v.weight_decay[m] != 0 else None for m in models
        ]
        _inplace(torch._foreach_mul_, decay, params)
    _inplace(torch._foreach_lerp_, [1 - v.beta1[m] for m in models], exp_avgs, g)
    _inplace(torch._foreach_mul_, [v.beta2[m] for m in models], exp_avg_sqs)
    _inplace(torch._foreach_addcmul_, [1 - v.beta2[m] for m in models], exp_avg_sqs, g, g)
    del g
    # Per slice, in Python floats from the host step counts, as the stock code does.
    pairs = list(zip(models, steps, strict=True))
    step_size: Values = [-(v.lr[m] / (1 - v.beta1[m] ** s)) for m, s in pairs]
    bias2_sqrt: Values = [(1 - v.beta2[m] ** s) ** 0.5 for m, s in pairs]
    keeping_max = [v.amsgrad[m] for m in models]
    second = exp_avg_sqs
    if any(keeping_max):
        assert max_exp_avg_sqs is not None
        _inplace_where(torch._foreach_maximum_, keeping_max, max_exp_avg_sqs, exp_avg_sqs)
        second = chosen(keeping_max, max_exp_avg_sqs, exp_avg_sqs)
    denom = square_root(second)
    _inplace(torch._foreach_div_, bias2_sqrt, denom)
    _inplace(torch._foreach_add_, [v.eps[m] for m in models], denom)
    _inplace(torch._foreach_addcdiv_, step_size, params, exp_avgs, denom)
