"""Fused kernels: one batched operator for the K models' layer (HFTA, MLSys 2021).

HFTA (Wang et al., arXiv:2102.02344) fuses K linear layers into one batched matmul and K
convolutions into one grouped convolution. Here each kernel is an ``autograd.Function`` with a
``vmap`` rule: :class:`~waterwave_hpo.fusion.FusedModule` runs the user's ``forward`` under
``torch.func.vmap``, and when vmap reaches a fused layer it hands the rule the whole array at
once (inputs ``(K, B, ...)`` or shared ``(B, ...)``, weights ``(K, ...)``), which issues one
``torch.baddbmm`` or one grouped ``conv`` instead of vmap's generic batching of ``F.linear`` /
``F.conv*``. Autograd records the batched operator itself, so backward is one batched kernel too.
Outside vmap (K unbatched) each function is the stock operator.

Convolutions keep HFTA's channel layout: the output is returned as ``(B, K*O, ...)`` viewed
``(B, K, O, ...)`` with vmap's batch dimension 1, so the next fused convolution reads it without
a copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
import torch.nn.functional as F


def _reference_vjp(
    reference: Callable[..., torch.Tensor], inputs: tuple[Any, ...], grad: torch.Tensor
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of ``reference(*inputs)`` for the tensor inputs (None for the others)."""
    tensors = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]

    def of_tensors(*xs: torch.Tensor) -> torch.Tensor:
        args = list(inputs)
        for i, x in zip(tensors, xs, strict=True):
            args[i] = x
        return reference(*args)

    _, vjp, *_ = torch.func.vjp(of_tensors, *[inputs[i] for i in tensors])
    grads = vjp(grad)
    out: list[torch.Tensor | None] = [None] * len(inputs)
    for i, g in zip(tensors, grads, strict=True):
        out[i] = g
    return tuple(out)


def _leading(x: torch.Tensor | None, dim: int | None, size: int) -> torch.Tensor | None:
    """``x`` with its vmap dimension first (expanded to ``size`` if it has none)."""
    if x is None:
        return None
    if dim is None:
        return x.unsqueeze(0).expand(size, *x.shape)
    return _front(x, dim)


def _front(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x.movedim(dim, 0)``, without the no-op ``permute`` (one ATen operation) when dim is 0."""
    return x if dim == 0 else x.movedim(dim, 0)


class _BatchedLinear(torch.autograd.Function):
    """``x @ w^T + b`` of K models at once: ``(K, N, in)``, ``(K, out, in)``, ``(K, out)``.

    One ``torch.baddbmm`` forward, as ``baddbmm(b, x, w.transpose(1, 2))`` would run; the
    backward differs in layout only. ``baddbmm``'s own backward computes the weight's gradient
    as ``x^T @ grad``, ``(K, in, out)``, and hands back its transpose; the parameter is
    ``(K, out, in)`` contiguous, so autograd's AccumulateGrad copies the gradient into the
    parameter's layout: two more operations (an allocation and a copy, each a kernel on a GPU)
    per layer and step. Here the gradient is computed in the parameter's layout,
    ``grad^T @ x``, as ``mm``'s backward does for one model's ``F.linear``.
    """

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        wt = weight.transpose(1, 2)
        if bias is None:
            return torch.bmm(x, wt)
        return torch.baddbmm(bias.unsqueeze(1), x, wt)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, weight, bias = inputs
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        needs_x, needs_w, needs_b = ctx.needs_input_grad
        grad_x = torch.bmm(grad, weight) if needs_x else None
        grad_w = torch.bmm(grad.transpose(1, 2), x) if needs_w else None
        grad_b = grad.sum(1) if ctx.has_bias and needs_b else None
        return grad_x, grad_w, grad_b


def batched_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """K linear layers as one batched matmul: ``(K, N, in) -> (K, N, out)``.

    Args:
        x: ``(K, N, in)``, one batch per model (an expanded shared batch is fine).
        weight: ``(K, out, in)``.
        bias: ``(K, out)`` or None.

    Returns:
        ``(K, N, out)``; the weight's gradient comes back in its own layout (no copy).
    """
    out: torch.Tensor = _BatchedLinear.apply(  # type: ignore[no-untyped-call,unused-ignore]
        x, weight, bias
    )
    return out


class _LinearFn(torch.autograd.Function):
    """``F.linear`` whose vmap rule is one ``torch.baddbmm`` over the K models."""

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.inputs = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _reference_vjp(F.linear, ctx.inputs, grad)

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[int | None, ...],
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, int]:
        x_dim, w_dim, b_dim = in_dims
        k = info.batch_size
        w = _leading(weight, w_dim, k)
        assert w is not None
        b = _leading(bias, b_dim, k)
        if x_dim is None:
            lead = x.shape[:-1]
            x3 = x.reshape(1, -1, x.shape[-1]).expand(k, -1, -1)
        else:
            xk = _front(x, x_dim)
            lead = xk.shape[1:-1]
            x3 = xk.reshape(k, -1, xk.shape[-1])
        out = batched_linear(x3, w, b)
        return out.reshape(k, *lead, w.shape[1]), 0


class _ConvFn(torch.autograd.Function):
    """``F.conv1d``/``F.conv2d`` whose vmap rule is one grouped convolution over the K models."""

    @staticmethod
    def forward(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        stride: Any,
        padding: Any,
        dilation: Any,
        groups: int,
    ) -> torch.Tensor:
        conv = F.conv1d if weight.dim() == 3 else F.conv2d
        return conv(x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.inputs = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _reference_vjp(_ConvFn.forward, ctx.inputs, grad)

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[int | None, ...],
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        stride: Any,
        padding: Any,
        dilation: Any,
        groups: int,
    ) -> tuple[torch.Tensor, int]:
        x_dim, w_dim, b_dim = in_dims[:3]
        k = info.batch_size
        w = _leading(weight, w_dim, k)
        assert w is not None
        b = _leading(bias, b_dim, k)
        conv = F.conv1d if w.dim() == 4 else F.conv2d
        out_channels = w.shape[1]
        fused_weight = w.reshape(k * out_channels, *w.shape[2:])
        fused_bias = None if b is None else b.reshape(-1)
        # One model's input is (N, C, *S), or (C, *S) unbatched.
        unbatched = x.dim() - (0 if x_dim is None else 1) == w.dim() - 2
        if x_dim is None:
            xs = x.unsqueeze(0) if unbatched else x
            if groups == 1:
                # One input for all: a plain convolution with K*O output channels, no copy.
                out = conv(xs, fused_weight, fused_bias, stride, padding, dilation, 1)
            else:
                xs = xs.unsqueeze(1).expand(xs.shape[0], k, *xs.shape[1:])
                xs = xs.reshape(xs.shape[0], -1, *xs.shape[3:])
                out = conv(xs, fused_weight, fused_bias, stride, padding, dilation, k * groups)
        else:
            xk = _front(x, x_dim)
            if unbatched:
                xk = xk.unsqueeze(1)
            # (K, N, C, *S) -> (N, K*C, *S): a view when x came from a fused conv (dim 1).
            xs = xk.transpose(0, 1).reshape(xk.shape[1], -1, *xk.shape[3:])
            out = conv(xs, fused_weight, fused_bias, stride, padding, dilation, k * groups)
        out = out.view(out.shape[0], k, out_channels, *out.shape[2:])
        if unbatched:
            return out[0], 0
        return out, 1


class FusedLinear(nn.Module):
    """``nn.Linear`` run as one batched matmul over the K fused models (HFTA, MLSys 2021).

    Holds the same ``weight`` ``(K, out, in)`` and ``bias`` ``(K, out)`` as the layer it
    replaces; inside :class:`~waterwave_hpo.fusion.FusedModule` it runs under vmap (outside
    vmap it is the stock operator).

    Args:
        linear: The layer it replaces (its parameters are taken over, not copied).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., in) -> (..., out)`` for one model (under vmap: all K at once)."""
        out: torch.Tensor = _LinearFn.apply(  # type: ignore[no-untyped-call,unused-ignore]
            x, self.weight, self.bias
        )
        return out


class FusedConv(nn.Module):
    """``nn.Conv1d``/``nn.Conv2d`` run as one grouped convolution over the K models (HFTA).

    HFTA's fused convolution: the K models' channels side by side, ``groups`` times K.
    Holds the same ``weight`` ``(K, O, C/groups, *kernel)`` and ``bias`` ``(K, O)``.

    Attributes:
        autotune: Whether the fused module's traced or ``nn.Sequential`` path may run this
            layer (2-d, ``groups=1``, on the CPU) as one batched matrix product instead of the
            grouped convolution where a one-time timing finds it faster (True by default).
        forms: The form chosen per input shape, dtype and grad mode, ``"grouped"`` or
            ``"bmm"`` (filled at the first forward of each shape).

    Args:
        conv: The layer it replaces (zero padding only; its parameters are taken over).
    """

    def __init__(self, conv: nn.Conv1d | nn.Conv2d) -> None:
        super().__init__()
        self.in_channels = conv.in_channels
        self.out_channels = conv.out_channels
        self.stride = conv.stride
        self.padding = conv.padding
        self.dilation = conv.dilation
        self.groups = conv.groups
        self.weight = conv.weight
        self.bias = conv.bias
        self.autotune = True
        self.forms: dict[tuple[Any, ...], str] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, C, *S) -> (N, O, *S')`` (or unbatched ``(C, *S)``) for one model."""
        out: torch.Tensor = _ConvFn.apply(  # type: ignore[no-untyped-call,unused-ignore]
            x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups
        )
        return out


def kernel_module(module: nn.Module) -> nn.Module | None:
    """The fused-kernel layer that replaces ``module``, or None if it keeps vmap's batching.

    Args:
        module: A layer of the stacked model (its parameters already ``(K, ...)``).

    Returns:
        A :class:`FusedLinear` for ``nn.Linear``, a :class:`FusedConv` for a zero-padded
        ``nn.Conv1d``/``nn.Conv2d``; None otherwise.
    """
    if type(module) is nn.Linear:
        return FusedLinear(module)
    if type(module) in (nn.Conv1d, nn.Conv2d):
        conv: nn.Conv1d | nn.Conv2d = module  # type: ignore[assignment]
        if conv.padding_mode == "zeros":
            return FusedConv(conv)
    return None
