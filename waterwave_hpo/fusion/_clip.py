"""Gradient-norm clipping per model of a fused group.

``torch.nn.utils.clip_grad_norm_`` on a fused module's parameters would take one norm over all K
models: one model's large (or NaN) gradient would scale every other model's. Here each model's
gradients are clipped by that model's own norm, as ``clip_grad_norm_`` on the model alone would
(same formula: coefficient ``min(1, max_norm / (norm + 1e-6))``). Per-model operators are the
premise of HFTA's fused training array (Wang et al., MLSys 2021, arXiv:2102.02344).
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence
import math

import torch
from torch import nn

from waterwave_hpo._checks import type_error
from waterwave_hpo._checks import value_error
from waterwave_hpo.fusion._optim import _is_number
from waterwave_hpo.fusion._optim import _named_parameters
from waterwave_hpo.fusion._optim import host_to_device


def _max_norms(max_norm: object, num_models: int) -> list[float]:
    """``max_norm`` as one positive finite float per model, or a clear error."""
    fix = f"pass a number > 0, or {num_models} of them, one per model"
    values = list(max_norm) if isinstance(max_norm, Sequence) else [max_norm] * num_models
    if isinstance(max_norm, (str, bytes)) or not all(_is_number(v) for v in values):
        raise type_error("max_norm", max_norm, "a number or a sequence of numbers", fix)
    if len(values) != num_models:
        raise value_error(
            "max_norm", max_norm, f"has {len(values)} entries but there are K={num_models}", fix
        )
    floats = [float(v) for v in values]  # type: ignore[arg-type]
    if not all(v > 0 and math.isfinite(v) for v in floats):
        raise value_error("max_norm", max_norm, "must be > 0 and finite", fix)
    return floats


@torch.no_grad()
def clip_grad_norm_(
    fused_or_params: nn.Module | Iterable[torch.Tensor],
    max_norm: float | Sequence[float],
    norm_type: float = 2.0,
    *,
    num_models: int | None = None,
) -> torch.Tensor:
    """Clip each model's gradients to its own norm, in place; the fused ``clip_grad_norm_``.

    Model k's gradients (slice k of every parameter's ``.grad``, shape ``(K, *shape)``) are
    scaled by ``min(1, max_norm[k] / (norm_k + 1e-6))``, where ``norm_k`` is the ``norm_type``
    norm of all of model k's gradients together, as ``torch.nn.utils.clip_grad_norm_`` computes
    it for one model. Parameters without a gradient are skipped. No host sync.

    Args:
        fused_or_params: A fused module, or its parameters (leading dim K), as for
            :func:`optimizer`.
        max_norm: The largest norm, for every model or one per model (``len == K``).
        norm_type: The p of the p-norm (``math.inf`` for the max norm).
        num_models: K, if it cannot be read from the module or the parameters.

    Returns:
        Each model's norm before clipping, shape ``(K,)`` (0 for a model without gradients).

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: ``max_norm`` is not positive and finite or has the wrong length; a parameter
            has no leading dim K.
    """
    named, k = _named_parameters(fused_or_params, num_models)
    limits = _max_norms(max_norm, k)
    if not _is_number(norm_type) or float(norm_type) <= 0:
        raise value_error(
            "norm_type", norm_type, "must be a number > 0", "pass e.g. 2.0, or math.inf"
        )
    grads = [p.grad for _, p in named if p.grad is not None]
    if not grads:
        return torch.zeros(k)
    device = grads[0].device
    ord_ = float(norm_type)
    per_param = [torch.linalg.vector_norm(g.flatten(1), ord_, dim=1).to(device) for g in grads]
    norms: torch.Tensor = torch.linalg.vector_norm(torch.stack(per_param), ord_, dim=0)  # (K,)
    if all(m == limits[0] for m in limits):  # one limit: a scalar argument, no copy at all
        coefficient = torch.clamp(float(limits[0]) / (norms + 1e-6), max=1.0)
    else:  # per-model limits: queued from pinned memory, never a blocking copy per step
        limit = host_to_device(torch.tensor(limits, dtype=norms.dtype), device)
        coefficient = torch.clamp(limit / (norms + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coefficient.to(g.dtype).reshape((k,) + (1,) * (g.dim() - 1)))
    return norms
