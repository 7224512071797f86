"""Dropout whose rate is a buffer, so each fused model keeps its own rate.

``nn.Dropout`` holds its rate as a Python float, the same for every model that
``functional_call`` runs through one template. Here the rate is a 0-d buffer ``rate``: stacked to
``(K,)`` it is batched by ``torch.func.vmap`` like the weights, and ``randomness="different"``
gives each model its own mask (HFTA, Wang et al., MLSys 2021, fuses dropout the same way: one
mask per array member).

Attention layers (timm's ``Attention``, transformers' BERT and GPT-2) read ``dropout.p`` as a
Python float to pass it to ``F.scaled_dot_product_attention``. :attr:`PerModelDropout.p` is
therefore that float while the K rates are equal; when they differ, reading it raises an error
that says so (a tensor there would fail inside vmap on ``.item()``).

Under vmap (a model that runs whole under ``torch.func.vmap``) the mask comes from
:class:`_DropoutFactor`, whose vmap rule draws the K models' masks in one ``rand`` over the
stacked shape and scales them by the K rates' cached factors: one step then runs the
operations of one model's dropout (draw, compare, scale, multiply; one multiply backward),
not vmap's per-call batching of the rate arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


class PerModelDropout(nn.Module):
    """``nn.Dropout`` with its rate in a buffer ``rate`` (0-d per model, ``(K,)`` when fused).

    In training mode each element is zeroed with probability ``rate`` and the rest scaled by
    ``1 / (1 - rate)`` (``rate = 1`` zeroes everything), as ``nn.Dropout``; in eval mode the
    input passes unchanged.

    Args:
        p: The dropout rate, in [0, 1].
    """

    rate: torch.Tensor

    def __init__(self, p: float) -> None:
        super().__init__()
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(
                f"p={p!r}: must be a dropout rate in [0, 1]; pass e.g. p=0.1 (p=0 keeps "
                "every element)"
            )
        # float64, so the rate reads back exactly as the float the user gave.
        self.register_buffer("rate", torch.tensor(float(p), dtype=torch.float64))
        self._rates: tuple[float, ...] = (float(p),)
        self._rates_seen = (id(self.rate), self.rate._version)
        self._factors: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def set_rates(self, rates: Sequence[float]) -> None:
        """Give the K fused models their rates: ``rate`` becomes ``(K,)``.

        Args:
            rates: One rate per model, each in [0, 1].
        """
        self._rates = tuple(float(r) for r in rates)
        self.rate = torch.tensor(self._rates, dtype=torch.float64, device=self.rate.device)
        self._rates_seen = (id(self.rate), self.rate._version)

    @property
    def rates(self) -> tuple[float, ...]:
        """The K models' rates as Python floats (a host copy of ``rate``).

        Read back from ``rate`` only when it was replaced or written other than by
        :meth:`set_rates` (e.g. ``load_state_dict``): once, not every step.
        """
        seen = (id(self.rate), self.rate._version)
        if getattr(self, "_rates_seen", None) != seen:
            self._rates = tuple(float(r) for r in self.rate.reshape(-1).tolist())
            self._rates_seen = seen
        return self._rates

    @property
    def p(self) -> float:
        """The rate as a Python float, as ``nn.Dropout.p`` (what attention layers read).

        Raises:
            RuntimeError: The fused models' rates differ (one float cannot stand for them).
        """
        if len(set(self._rates)) != 1:
            raise RuntimeError(
                f"dropout rates {list(self._rates)} differ between the fused models and the "
                "model reads this layer's rate as one Python number (e.g. to pass it to "
                "scaled_dot_product_attention)"
            )
        return self._rates[0]

    def factors(
        self, dtype: torch.dtype, shape: tuple[int, ...], rate: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keep probability ``1 - rate`` and the scale ``1 / keep`` (0 where keep is 0).

        Computed once per rate, dtype and shape (``rate`` viewed to ``shape``), not per step.

        Args:
            dtype: The activations' dtype.
            shape: The view the values must take to broadcast, e.g. ``(K, 1, 1)``.
            rate: The rates to use instead of ``rate`` (the stacked buffer as vmap's rule
                receives it, while ``rate`` is vmap's wrapper of it).

        Returns:
            ``(keep, scale)``, each of ``shape``, on ``rate``'s device.
        """
        rate = self.rate if rate is None else rate
        key = (id(rate), rate._version, rate.device, dtype, shape)
        cached = self._factors.get(key)
        # The entry holds ``rate`` itself: its id cannot be reused by another tensor meanwhile.
        if cached is None or cached[0] is not rate:
            with torch.no_grad():
                keep = (1.0 - rate.to(dtype)).view(shape)
                scale = torch.where(keep > 0, 1.0 / keep, torch.zeros_like(keep))
            self._factors = {k: v for k, v in self._factors.items() if k[:2] == key[:2]}
            cached = self._factors[key] = (rate, keep, scale)
        return cached[1], cached[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Drop elements of ``x`` (any shape) at rate ``rate``; same shape out."""
        if not self.training:
            return x
        factor: torch.Tensor = _DropoutFactor.apply(  # type: ignore[no-untyped-call,unused-ignore]
            x, self.rate, self
        )
        return x * factor


class _DropoutFactor(torch.autograd.Function):
    """The factor a dropout multiplies by: 0 (dropped) or ``1 / (1 - rate)``, shaped as ``x``.

    Not differentiable (the gradient flows through ``x * factor``). Its vmap rule draws the K
    models' masks in one ``torch.rand`` (one independent mask per model, as vmap's
    ``randomness="different"``; one shared mask under ``"same"``).
    """

    @staticmethod
    def forward(x: torch.Tensor, rate: torch.Tensor, layer: PerModelDropout) -> torch.Tensor:
        keep = 1.0 - rate.to(x.dtype)
        scale = torch.where(keep > 0, 1.0 / keep, torch.zeros_like(keep))
        return (torch.rand_like(x) < keep) * scale

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.mark_non_differentiable(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        return None, None, None

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[int | None, ...],
        x: torch.Tensor,
        rate: torch.Tensor,
        layer: PerModelDropout,
    ) -> tuple[torch.Tensor, int | None]:
        x_dim, rate_dim = in_dims[:2]
        k = info.batch_size
        one = x.shape if x_dim is None else x.shape[:x_dim] + x.shape[x_dim + 1 :]
        _refuse_if_error(info.randomness)
        if rate_dim is None:
            # One rate for the K models, broadcast.
            keep, scale = layer.factors(x.dtype, (1,) * (len(one) + 1), rate)
        else:
            rates = rate if rate_dim == 0 else rate.movedim(rate_dim, 0)
            keep, scale = layer.factors(x.dtype, (k,) + (1,) * len(one), rates)
        if info.randomness == "same":
            draw = torch.rand(one, dtype=x.dtype, device=x.device)
        else:
            draw = torch.rand((k, *one), dtype=x.dtype, device=x.device)
        return (draw < keep) * scale, 0


def _refuse_if_error(randomness: str) -> None:
    """Refuse random operations as vmap does under ``randomness="error"``."""
    if randomness == "error":
        raise RuntimeError(
            'randomness="error": vmap refuses random operations (dropout in training mode); '
            'pass randomness="different" or "same", or put the model in eval mode'
        )
