"""Two forms of K fused 2-d convolutions, and a one-time choice between them per layer and shape.

HFTA (Wang et al., MLSys 2021, arXiv:2102.02344) runs K convolutions as one grouped convolution,
``groups`` times K. On a CPU the grouped convolution's backward is slow where the channels are
many and the image small (the last stages of a ResNet at 32x32: 256-512 channels per group, 2x2
and 1x1 pixels): oneDNN's and ATen's own grouped kernels there took about twice the time of the K
dense convolutions together (experiments/results/2026-11-27-fusion-2/). The same arithmetic as
one batched matrix product over the K models (im2col, ``torch.bmm``, col2im in backward) runs at
about the speed of the K dense convolutions there, and slower on large images.

:func:`fused_conv2d` picks per layer and input shape, once, by timing both forms forward and
backward on the layer's own weights and input (as cuDNN's benchmark mode picks an algorithm per
shape), and caches the choice on the layer (:attr:`FusedConv.forms`). The choice is made on the
CPU only: on CUDA the grouped convolution stays (cuDNN chooses its algorithm; timing here would
wait for the device, a host synchronisation in the step).
"""

from __future__ import annotations

from collections.abc import Callable
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from waterwave_hpo.fusion._kernels import FusedConv

GROUPED = "grouped"
"""One grouped convolution, ``groups`` times K (HFTA's form)."""

BATCHED_MATMUL = "bmm"
"""im2col, one ``torch.bmm`` over the K models, and the result put back in HFTA's layout."""

_MARGIN = 0.85
"""The batched-matmul form is chosen only if it takes under this share of the grouped form's
time: a near tie keeps HFTA's form (fewer operations per step)."""

_REPEATS = 3
"""Timed runs of each form (after one warm-up); the fastest run counts."""


Geometry = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]
"""A layer's ``(stride, padding, dilation, groups)``, padding as numbers."""


def grouped(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    geometry: Geometry,
) -> torch.Tensor:
    """K convolutions as one grouped convolution: ``(N, K*C, H, W) -> (N, K*O, H', W')``."""
    stride, padding, dilation, groups = geometry
    flat_bias = None if bias is None else bias.flatten()
    return F.conv2d(x, weight.flatten(0, 1), flat_bias, stride, padding, dilation, k * groups)


def batched_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    geometry: Geometry,
) -> torch.Tensor:
    """K convolutions (``groups=1`` each) as im2col and one ``bmm``, in and out of HFTA's layout.

    ``x`` ``(N, K*C, H, W)`` unfolds to ``(N, K*C*kh*kw, L)``, model k's columns are its
    ``C*kh*kw`` rows; they are multiplied by the K weights ``(K, O, C*kh*kw)`` in one batched
    product ``(K, O, N*L)``, viewed back as ``(N, K*O, H', W')``. Autograd's backward is two
    batched products and a col2im (``F.fold``).
    """
    stride, padding, dilation, _ = geometry
    n, _, height, _ = x.shape
    out_channels, kh, kw = weight.shape[1], weight.shape[3], weight.shape[4]
    rows = weight.shape[2] * kh * kw
    cols = F.unfold(x, (kh, kw), dilation, padding, stride)
    length = cols.shape[-1]
    cols = cols.view(n, k, rows, length).permute(1, 2, 0, 3).reshape(k, rows, n * length)
    w = weight.view(k, out_channels, rows)
    y = torch.bmm(w, cols) if bias is None else torch.baddbmm(bias.unsqueeze(2), w, cols)
    out_h = (height + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    y = y.view(k, out_channels, n, length).permute(2, 0, 1, 3)
    return y.reshape(n, k * out_channels, out_h, length // out_h)


Form = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", int, Geometry], torch.Tensor]

_FORMS: dict[str, Form] = {GROUPED: grouped, BATCHED_MATMUL: batched_matmul}


def _seconds(
    form: Form,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    geometry: Geometry,
    backward: bool,
) -> float:
    """The fastest of ``_REPEATS`` runs of ``form`` (forward, and backward if asked), seconds."""
    best = float("inf")
    for repeat in range(_REPEATS + 1):
        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            y = form(x, weight, bias, k, geometry)
            if backward:
                torch.autograd.backward(y.sum())
        if repeat:  # the first run warms up (allocations, oneDNN's primitive cache)
            best = min(best, time.perf_counter() - start)
    return best


def _choose(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    geometry: Geometry,
    backward: bool,
) -> str:
    """Time both forms on copies of the layer's weights and this input; the faster one."""

    def copy(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone().requires_grad_(backward)

    args = (copy(x), copy(weight), None if bias is None else copy(bias), k, geometry, backward)
    times = {name: _seconds(form, *args) for name, form in _FORMS.items()}
    return BATCHED_MATMUL if times[BATCHED_MATMUL] < _MARGIN * times[GROUPED] else GROUPED


def fused_conv2d(layer: FusedConv, x: torch.Tensor, k: int) -> torch.Tensor:
    """K 2-d convolutions on HFTA's layout in the form chosen for this layer and input shape.

    The choice is timed at the first call per input shape, dtype and grad mode (a few
    milliseconds to a second, once) and kept in ``layer.forms``. The grouped form is taken
    without timing where the other does not apply: ``layer.autotune`` False, grouped layers,
    string padding, a device other than the CPU; and, until a choice is made, under a tensor
    subclass or a dispatch mode (fake tensors, an operation counter), where nothing can be timed.

    Args:
        layer: The fused layer (weight ``(K, O, C/groups, kh, kw)``, bias ``(K, O)``).
        x: The input in HFTA's layout, ``(N, K*C, H, W)``.
        k: K.

    Returns:
        ``(N, K*O, H', W')``, model k's channels ``[k*O, (k+1)*O)``.
    """
    padding = layer.padding
    geometry: Geometry = (
        tuple(layer.stride),
        (0, 0) if isinstance(padding, str) else tuple(padding),
        tuple(layer.dilation),
        layer.groups,
    )
    if isinstance(padding, str):
        stride, _, dilation, groups = geometry
        bias = None if layer.bias is None else layer.bias.flatten()
        w = layer.weight.flatten(0, 1)
        return F.conv2d(x, w, bias, stride, padding, dilation, k * groups)
    if not layer.autotune or layer.groups != 1 or x.device.type != "cpu":
        return grouped(x, layer.weight, layer.bias, k, geometry)
    backward = torch.is_grad_enabled() and (
        x.requires_grad or any(p.requires_grad for p in layer.parameters())
    )
    key = (tuple(x.shape), x.dtype, backward)
    form = layer.forms.get(key)
    if form is None:
        if type(x) is not torch.Tensor or _get_current_dispatch_mode() is not None:  # type: ignore[no-untyped-call,unused-ignore]
            # Fake tensors, a counter of operations: nothing to time; the choice stays open.
            return grouped(x, layer.weight, layer.bias, k, geometry)
        form = layer.forms[key] = _choose(x, layer.weight, layer.bias, k, geometry, backward)
    return _FORMS[form](x, layer.weight, layer.bias, k, geometry)
