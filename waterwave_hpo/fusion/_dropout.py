"""Dropout whose rate is a buffer, so each fused model keeps its own rate.

``nn.Dropout`` holds its rate as a Python float, the same for every model that
``functional_call`` runs through one template. Here the rate is a 0-d buffer: stacked to
``(K,)`` it is batched by ``torch.func.vmap`` like the weights, and ``randomness="different"``
gives each model its own mask (HFTA, Wang et al., MLSys 2021, fuses dropout the same way: one
mask per array member).
"""

from __future__ import annotations

import torch
from torch import nn


class PerModelDropout(nn.Module):
    """``nn.Dropout`` with its rate ``p`` in a buffer (0-d per model, ``(K,)`` when fused).

    In training mode each element is zeroed with probability ``p`` and the rest scaled by
    ``1 / (1 - p)`` (``p = 1`` zeroes everything), as ``nn.Dropout``; in eval mode the input
    passes unchanged.

    Args:
        p: The dropout rate, in [0, 1].
    """

    p: torch.Tensor

    def __init__(self, p: float) -> None:
        super().__init__()
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(
                f"p={p!r}: must be a dropout rate in [0, 1]; pass e.g. p=0.1 (p=0 keeps "
                "every element)"
            )
        # float64, so the rate reads back exactly as the float the user gave.
        self.register_buffer("p", torch.tensor(float(p), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Drop elements of ``x`` (any shape) at rate ``p``; same shape out."""
        if not self.training:
            return x
        keep = 1.0 - self.p.to(x.dtype)
        mask = torch.rand_like(x) < keep
        scale = torch.where(keep > 0, 1.0 / keep, torch.zeros_like(keep))
        return x * mask * scale
