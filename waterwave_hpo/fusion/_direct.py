"""The layers of a fused ``nn.Sequential`` run directly on the array, HFTA style, without vmap.

HFTA (Wang et al., MLSys 2021, arXiv:2102.02344) fuses each operator of K models into
one: Linear into a batched matmul, Conv into a grouped convolution, BatchNorm into one
BatchNorm over K times the channels, and elementwise operators need nothing at all. When the
user's model is an ``nn.Sequential`` its forward is nothing but its layers in order, so the fused
module can run those fused operators one after another on the stacked activations ``(K, B,
...)``, with no ``torch.func`` machinery per step; a layer without a direct form (the user's
own module, a layer under another layout) runs through ``vmap`` alone. Measured on this CPU in
experiments/results/2026-11-23-fusion-kernels/.

Every function here takes a layer of the fused model (its parameters and buffers ``(K, ...)``),
the activation ``x`` and whether ``x`` is one shared batch ``(B, ...)`` or stacked ``(K, B,
...)``, and returns ``(y, y_shared)``, or None when it has no direct form for that input (the
caller then uses vmap for that layer).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
import torch.nn.functional as F

from waterwave_hpo.fusion._dropout import PerModelDropout
from waterwave_hpo.fusion._kernels import FusedConv
from waterwave_hpo.fusion._kernels import FusedLinear

Result = tuple[torch.Tensor, bool] | None
"""``(y, y_shared)`` or None (no direct form; run the layer through vmap)."""

ELEMENTWISE: tuple[type[nn.Module], ...] = (
    nn.Identity,
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Hardtanh,
    nn.Mish,
    nn.Softplus,
)
"""Layers that act element by element: the same on ``(K, B, ...)`` as on each ``(B, ...)``."""

POOLS: dict[type[nn.Module], int] = {
    nn.MaxPool1d: 1,
    nn.AvgPool1d: 1,
    nn.AdaptiveAvgPool1d: 1,
    nn.MaxPool2d: 2,
    nn.AvgPool2d: 2,
    nn.AdaptiveAvgPool2d: 2,
}
"""Per-channel pooling layers and their spatial dimensions."""


def _stack(x: torch.Tensor, shared: bool, k: int) -> torch.Tensor:
    """``x`` as ``(K, B, ...)``: a shared batch is expanded (a view, no copy)."""
    return x.unsqueeze(0).expand(k, *x.shape) if shared else x


def _to_channels(x: torch.Tensor) -> torch.Tensor:
    """``(K, N, C, *S) -> (N, K*C, *S)``, HFTA's layout: a view when ``x`` came from it."""
    return x.transpose(0, 1).reshape(x.shape[1], -1, *x.shape[3:])


def _from_channels(y: torch.Tensor, k: int) -> torch.Tensor:
    """``(N, K*C, *S) -> (K, N, C, *S)``, a view."""
    return y.view(y.shape[0], k, -1, *y.shape[2:]).transpose(0, 1)


def linear(layer: FusedLinear, x: torch.Tensor, shared: bool, k: int) -> Result:
    """K linear layers as one matmul: shared ``(B..., in)``, or stacked as one ``baddbmm``."""
    w, b = layer.weight, layer.bias
    out_features, in_features = w.shape[1], w.shape[2]
    if shared:
        # One input for all: one GEMM against the K weights side by side, (N, K*out).
        flat = x.reshape(-1, in_features)
        y = F.linear(flat, w.reshape(-1, in_features), None if b is None else b.reshape(-1))
        y = y.view(-1, k, out_features).transpose(0, 1)
        return y.reshape(k, *x.shape[:-1], out_features), False
    x3 = x.reshape(k, -1, in_features)
    wt = w.transpose(1, 2)
    y = torch.bmm(x3, wt) if b is None else torch.baddbmm(b.unsqueeze(1), x3, wt)
    return y.view(k, *x.shape[1:-1], out_features), False


def conv(layer: FusedConv, x: torch.Tensor, shared: bool, k: int) -> Result:
    """K convolutions as one grouped convolution (HFTA); batched inputs ``(N, C, *S)`` only."""
    w, b = layer.weight, layer.bias
    spatial = w.dim() - 3
    if x.dim() != spatial + (2 if shared else 3):
        return None
    fn: Callable[..., torch.Tensor] = F.conv1d if spatial == 1 else F.conv2d
    fused_w = w.reshape(-1, *w.shape[2:])
    fused_b = None if b is None else b.reshape(-1)
    args = (layer.stride, layer.padding, layer.dilation)
    if shared and layer.groups == 1:
        # One input for all: a plain convolution with K*O output channels, no input copy.
        return _from_channels(fn(x, fused_w, fused_b, *args, 1), k), False
    xs = _to_channels(_stack(x, shared, k))
    return _from_channels(fn(xs, fused_w, fused_b, *args, k * layer.groups), k), False


def batch_norm(
    layer: nn.BatchNorm1d | nn.BatchNorm2d, x: torch.Tensor, shared: bool, k: int
) -> Result:
    """K BatchNorms as one over K times the channels; running statistics stay per model."""
    stacked = _stack(x, shared, k)
    if stacked.dim() < 3 or layer.momentum is None:
        return None  # unbatched (C,) inputs: vmap's batch_norm
    xs = _to_channels(stacked)
    mean, var = layer.running_mean, layer.running_var
    use_batch = layer.training or mean is None
    if layer.training and layer.num_batches_tracked is not None:
        layer.num_batches_tracked.add_(1)
    y = F.batch_norm(
        xs,
        None if mean is None else mean.view(-1),
        None if var is None else var.view(-1),
        None if layer.weight is None else layer.weight.view(-1),
        None if layer.bias is None else layer.bias.view(-1),
        use_batch,
        layer.momentum,
        layer.eps,
    )
    return _from_channels(y, k), False


def layer_norm(layer: nn.LayerNorm, x: torch.Tensor, shared: bool, k: int) -> Result:
    """K LayerNorms: one normalization, then each model's scale and shift broadcast."""
    xs = _stack(x, shared, k)
    y = F.layer_norm(xs, layer.normalized_shape, None, None, layer.eps)
    view = (k,) + (1,) * (xs.dim() - 1 - len(layer.normalized_shape)) + layer.normalized_shape
    if layer.weight is not None:
        y = y * layer.weight.view(view)
    if layer.bias is not None:
        y = y + layer.bias.view(view)
    return y, False


def embedding(layer: nn.Embedding, x: torch.Tensor, shared: bool, k: int) -> Result:
    """K embeddings as one lookup in the K tables side by side."""
    if layer.padding_idx is not None or layer.max_norm is not None or layer.sparse:
        return None
    if layer.scale_grad_by_freq:
        return None
    w = layer.weight
    rows = w.shape[1]
    offsets = torch.arange(k, device=x.device).view(k, *([1] * (x.dim() - (0 if shared else 1))))
    index = (x.unsqueeze(0) if shared else x) + offsets * rows
    return F.embedding(index, w.reshape(-1, w.shape[2])), False


def dropout(layer: PerModelDropout, x: torch.Tensor, shared: bool, k: int) -> Result:
    """K dropouts, each at its own rate, masks drawn independently."""
    if not layer.training:
        return x, shared
    xs = _stack(x, shared, k)
    keep = (1.0 - layer.rate.to(xs.dtype)).view(k, *([1] * (xs.dim() - 1)))
    scale = torch.where(keep > 0, 1.0 / keep, torch.zeros_like(keep))
    return xs * (torch.rand_like(xs) < keep) * scale, False


def pool(layer: nn.Module, x: torch.Tensor, shared: bool, k: int) -> Result:
    """Per-channel pooling over K times the channels."""
    dims = POOLS[type(layer)]
    if getattr(layer, "return_indices", False) or x.dim() != dims + (2 if shared else 3):
        return None
    if shared:
        return layer(x), True
    return _from_channels(layer(_to_channels(x)), k), False


def flatten(layer: nn.Flatten, x: torch.Tensor, shared: bool, k: int) -> Result:
    """``Flatten`` with its dimensions moved past the model dimension."""
    if shared:
        return layer(x), True
    start = layer.start_dim + 1 if layer.start_dim >= 0 else layer.start_dim
    end = layer.end_dim + 1 if layer.end_dim >= 0 else layer.end_dim
    return x.flatten(start, end), False


def elementwise(layer: nn.Module, x: torch.Tensor, shared: bool, k: int) -> Result:
    """An elementwise layer: the same on the whole array."""
    return layer(x), shared


def direct_form(layer: nn.Module) -> Callable[[nn.Module, torch.Tensor, bool, int], Result] | None:
    """The direct function for ``layer``, or None if it always runs through vmap.

    Args:
        layer: A layer of the fused model.

    Returns:
        One of this module's functions (it may still return None for a given input).
    """
    kind = type(layer)
    table: dict[type[nn.Module], Callable[..., Result]] = {
        FusedLinear: linear,
        FusedConv: conv,
        nn.BatchNorm1d: batch_norm,
        nn.BatchNorm2d: batch_norm,
        nn.LayerNorm: layer_norm,
        nn.Embedding: embedding,
        PerModelDropout: dropout,
        nn.Flatten: flatten,
    }
    if kind in table:
        return table[kind]
    if kind in POOLS:
        return pool
    if kind in ELEMENTWISE:
        return elementwise
    return None
