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
the activation ``x`` and its :class:`Layout`, and returns ``(y, y_layout)``, or None when it has
no direct form for that input (the caller then uses vmap for that layer). Each layer keeps the
layout it receives where it can: a convolution writes HFTA's ``(N, K*C, *S)`` and BatchNorm,
pooling, activations, dropout and ``Flatten`` read it as it is, so activations move between
them with no per-step reshape, permute or copy.
"""

from __future__ import annotations

from collections.abc import Callable
import enum

import torch
from torch import nn
import torch.nn.functional as F

from waterwave_hpo.fusion._conv_forms import fused_conv2d
from waterwave_hpo.fusion._dropout import PerModelDropout
from waterwave_hpo.fusion._kernels import FusedConv
from waterwave_hpo.fusion._kernels import FusedLinear
from waterwave_hpo.fusion._kernels import batched_linear


class Layout(enum.Enum):
    """How an activation of the K models is laid out between two fused layers.

    ``SHARED``: ``(B, ...)``, one batch every model reads. ``STACKED``: ``(K, B, ...)``, one
    batch per model. ``CHANNELS``: HFTA's layout ``(N, K*C, *S)``, the K models' channels side
    by side (model k's are ``[k*C, (k+1)*C)``): what a grouped convolution reads and writes, and
    what BatchNorm, pooling and elementwise layers read as it is. Chosen once per layer kind, so
    a run of convolutions, norms, activations and pools passes activations on with no reshape,
    permute or copy between them.
    """

    SHARED = "shared"
    STACKED = "stacked"
    CHANNELS = "channels"


Result = tuple[torch.Tensor, Layout] | None
"""``(y, y_layout)`` or None (no direct form; run the layer through vmap)."""

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


def stacked(x: torch.Tensor, layout: Layout, k: int) -> torch.Tensor:
    """``x`` as ``(K, B, ...)``: views only (a shared batch is expanded, not copied)."""
    if layout is Layout.SHARED:
        return x.unsqueeze(0).expand(k, *x.shape)
    if layout is Layout.CHANNELS:
        return x.view(x.shape[0], k, -1, *x.shape[2:]).transpose(0, 1)
    return x


def channels(x: torch.Tensor, layout: Layout, k: int) -> torch.Tensor:
    """``x`` as ``(N, K*C, *S)``: a copy from the other layouts (once, where a run starts)."""
    if layout is Layout.CHANNELS:
        return x
    xs = stacked(x, layout, k)
    return xs.transpose(0, 1).reshape(xs.shape[1], -1, *xs.shape[3:])


def linear(layer: FusedLinear, x: torch.Tensor, layout: Layout, k: int) -> Result:
    """K linear layers as one GEMM (shared 2-d input) or one ``baddbmm``."""
    w, b = layer.weight, layer.bias
    out_features, in_features = w.shape[1], w.shape[2]
    if layout is Layout.SHARED:
        # One input for all: one GEMM against the K weights side by side, (N, K*out).
        flat = x if x.dim() == 2 else x.reshape(-1, in_features)
        y = F.linear(flat, w.flatten(0, 1), None if b is None else b.flatten())
        if x.dim() == 2:
            return y, Layout.CHANNELS
        y = y.view(-1, k, out_features).transpose(0, 1)
        return y.reshape(k, *x.shape[:-1], out_features), Layout.STACKED
    if layout is Layout.CHANNELS and x.dim() == 2:
        # (N, K*in) viewed (K, N, in): HFTA's layout after a flatten, read without a copy.
        x3 = x.view(x.shape[0], k, in_features).transpose(0, 1)
        return batched_linear(x3, w, b), Layout.STACKED
    xs = stacked(x, layout, k)
    x3 = xs if xs.dim() == 3 else xs.reshape(k, -1, in_features)
    y = batched_linear(x3, w, b)
    if xs.dim() == 3:
        return y, Layout.STACKED
    return y.view(k, *xs.shape[1:-1], out_features), Layout.STACKED


def conv(layer: FusedConv, x: torch.Tensor, layout: Layout, k: int) -> Result:
    """K convolutions as one grouped convolution (HFTA) in and out of HFTA's layout."""
    w, b = layer.weight, layer.bias
    spatial = w.dim() - 3
    if x.dim() != spatial + (3 if layout is Layout.STACKED else 2):
        return None  # unbatched inputs: vmap
    fn: Callable[..., torch.Tensor] = F.conv1d if spatial == 1 else F.conv2d
    args = (layer.stride, layer.padding, layer.dilation)
    if layout is Layout.SHARED and layer.groups == 1:
        # One input for all: a plain convolution with K*O output channels, no input copy.
        fused_b = None if b is None else b.flatten()
        return fn(x, w.flatten(0, 1), fused_b, *args, 1), Layout.CHANNELS
    xs = channels(x, layout, k)
    if spatial == 2:
        # The grouped convolution or, where timed faster once on the CPU, one batched matmul.
        return fused_conv2d(layer, xs, k), Layout.CHANNELS
    fused_b = None if b is None else b.flatten()
    return fn(xs, w.flatten(0, 1), fused_b, *args, k * layer.groups), Layout.CHANNELS


def batch_norm(
    layer: nn.BatchNorm1d | nn.BatchNorm2d, x: torch.Tensor, layout: Layout, k: int
) -> Result:
    """K BatchNorms as one over K times the channels; running statistics stay per model."""
    if x.dim() < (3 if layout is Layout.STACKED else 2) or layer.momentum is None:
        return None  # unbatched (C,) inputs: vmap's batch_norm
    xs = channels(x, layout, k)
    mean, var = _flat_statistics(layer)
    use_batch = layer.training or mean is None
    if layer.training and layer.num_batches_tracked is not None:
        layer.num_batches_tracked.add_(1)
    y = F.batch_norm(
        xs,
        mean,
        var,
        None if layer.weight is None else layer.weight.view(-1),
        None if layer.bias is None else layer.bias.view(-1),
        use_batch,
        layer.momentum,
        layer.eps,
    )
    return y, Layout.CHANNELS


def _flat_statistics(
    layer: nn.BatchNorm1d | nn.BatchNorm2d,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The running mean and variance ``(K, C)`` viewed ``(K*C,)``, made once per buffer.

    Buffers take no gradient, so the views can outlive a step: BatchNorm updates them in place,
    which updates the stacked buffers they view. Made again when a buffer is replaced
    (``keep_models``, ``.to()``, loading a state dict into new tensors).
    """
    mean, var = layer.running_mean, layer.running_var
    cached = layer.__dict__.get("_fused_flat_statistics")
    if cached is None or cached[0] is not mean or cached[1] is not var:
        flat_mean = None if mean is None else mean.view(-1)
        flat_var = None if var is None else var.view(-1)
        cached = (mean, var, flat_mean, flat_var)
        layer.__dict__["_fused_flat_statistics"] = cached
    return cached[2], cached[3]


def layer_norm(layer: nn.LayerNorm, x: torch.Tensor, layout: Layout, k: int) -> Result:
    """K LayerNorms: one normalization, then each model's scale and shift broadcast."""
    xs = stacked(x, layout, k)
    y = F.layer_norm(xs, layer.normalized_shape, None, None, layer.eps)
    view = (k,) + (1,) * (xs.dim() - 1 - len(layer.normalized_shape)) + layer.normalized_shape
    if layer.weight is not None:
        y = y * layer.weight.view(view)
    if layer.bias is not None:
        y = y + layer.bias.view(view)
    return y, Layout.STACKED


def embedding(layer: nn.Embedding, x: torch.Tensor, layout: Layout, k: int) -> Result:
    """K embeddings as one lookup in the K tables side by side."""
    if layer.padding_idx is not None or layer.max_norm is not None or layer.sparse:
        return None
    if layer.scale_grad_by_freq or layout is Layout.CHANNELS:
        return None
    shared = layout is Layout.SHARED
    w = layer.weight
    rows = w.shape[1]
    offsets = torch.arange(k, device=x.device).view(k, *([1] * (x.dim() - (0 if shared else 1))))
    index = (x.unsqueeze(0) if shared else x) + offsets * rows
    return F.embedding(index, w.reshape(-1, w.shape[2])), Layout.STACKED


def dropout(layer: PerModelDropout, x: torch.Tensor, layout: Layout, k: int) -> Result:
    """K dropouts, each at its own rate, masks drawn independently."""
    if not layer.training or not any(layer.rates):
        return x, layout  # as torch's dropout at p=0: nothing drawn
    if layout is Layout.CHANNELS:
        # (N, K*F) viewed (N, K, F): each model's rate broadcast over its block.
        xs = x.view(x.shape[0], k, -1)
        keep, scale = layer.factors(x.dtype, (1, k, 1))
        return (xs * (torch.rand_like(xs) < keep) * scale).view(x.shape), Layout.CHANNELS
    xs = stacked(x, layout, k)
    keep, scale = layer.factors(x.dtype, (k,) + (1,) * (xs.dim() - 1))
    return xs * (torch.rand_like(xs) < keep) * scale, Layout.STACKED


def pool(layer: nn.Module, x: torch.Tensor, layout: Layout, k: int) -> Result:
    """Per-channel pooling over K times the channels."""
    dims = POOLS[type(layer)]
    if getattr(layer, "return_indices", False):
        return None
    if x.dim() != dims + (3 if layout is Layout.STACKED else 2):
        return None
    if layout is Layout.SHARED:
        return layer(x), Layout.SHARED
    return layer(channels(x, layout, k)), Layout.CHANNELS


def flatten(layer: nn.Flatten, x: torch.Tensor, layout: Layout, k: int) -> Result:
    """``Flatten`` with its dimensions moved past the model dimension.

    In HFTA's layout, flattening every dimension after the batch keeps the layout: model k's
    ``C*S`` features are the k-th block of ``(N, K*C*S)``.
    """
    if layout is Layout.SHARED:
        return layer(x), Layout.SHARED
    if layout is Layout.CHANNELS and layer.start_dim == 1 and layer.end_dim in (-1, x.dim() - 1):
        return x.flatten(1), Layout.CHANNELS
    xs = stacked(x, layout, k)
    start = layer.start_dim + 1 if layer.start_dim >= 0 else layer.start_dim
    end = layer.end_dim + 1 if layer.end_dim >= 0 else layer.end_dim
    return xs.flatten(start, end), Layout.STACKED


def elementwise(layer: nn.Module, x: torch.Tensor, layout: Layout, k: int) -> Result:
    """An elementwise layer: the same on the whole array, in any layout."""
    return layer(x), layout


def direct_form(
    layer: nn.Module,
) -> Callable[[nn.Module, torch.Tensor, Layout, int], Result] | None:
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
