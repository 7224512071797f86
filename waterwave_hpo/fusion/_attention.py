"""Scaled dot-product attention under vmap on the CPU: the math form, which batches.

``F.scaled_dot_product_attention`` on the CPU picks ``_scaled_dot_product_flash_attention_for_cpu``,
an operator without a vmap batching rule in torch 2.13: vmap then runs it once per model (a loop
of K calls: the operation count of a fused step grows with K) and its backward is not defined for
a mask that requires grad (T5's relative position bias: refused). The math form
(``aten::_scaled_dot_product_attention_math``, what the CPU runs when flash attention cannot)
decomposes into batched matmuls and a softmax. :class:`MathAttention` routes the calls made while
a fused forward runs there; a ``TorchFunctionMode`` is per thread, so co-hosted trials running
unfused in other threads keep torch's choice. CUDA keeps torch's choice too (flash and
memory-efficient attention have batching rules).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def _math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` by its math form; same arguments, same result."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # As torch's dispatcher does before any kernel: True takes part, False is -inf.
        attn_mask = torch.where(
            attn_mask,
            torch.zeros((), dtype=query.dtype, device=query.device),
            torch.full((), float("-inf"), dtype=query.dtype, device=query.device),
        )
    out = torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )
    return out[0]  # type: ignore[no-any-return]


class MathAttention(TorchFunctionMode):
    """Within it, ``F.scaled_dot_product_attention`` runs its math form (batchable by vmap)."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Route attention to :func:`_math`, every other function to itself."""
        if func is F.scaled_dot_product_attention:
            return _math(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))
