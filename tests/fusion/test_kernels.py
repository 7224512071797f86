"""Fused kernels, layer by layer: equal to K separate layers, forward and gradients.

Each layer is checked on both fused paths: inside an ``nn.Sequential`` (HFTA's direct path:
batched matmul, grouped convolution, BatchNorm over K*C channels, no vmap) and inside a user's
module (its forward runs under vmap, which hands the fused layers the whole array), with one
shared batch and with one batch per model. In float64 the fused kernels sum the same products
as the separate layers in another order, so they agree to ~1e-12, far inside the 1e-9 used;
in float32 (tests/fusion/test_fuse.py) the same reordering costs ~1e-6.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from waterwave_hpo import fusion
from waterwave_hpo.bench import count_ops

K = 3
TOL = {"rtol": 1e-9, "atol": 1e-9}


class Wrap(nn.Module):
    """A user's module: not a Sequential, so its forward runs under vmap."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)  # type: ignore[no-any-return]


LAYERS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "linear": (lambda: nn.Linear(6, 5), (4, 6)),
    "linear_no_bias_3d": (lambda: nn.Linear(6, 5, bias=False), (4, 2, 6)),
    "linear_unbatched": (lambda: nn.Linear(6, 5), (6,)),
    "conv1d": (lambda: nn.Conv1d(4, 6, 3, padding=1), (2, 4, 9)),
    "conv2d": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1), (2, 3, 7, 7)),
    "conv2d_groups": (lambda: nn.Conv2d(4, 6, 3, groups=2, bias=False), (2, 4, 6, 6)),
    "conv2d_unbatched": (lambda: nn.Conv2d(3, 4, 3), (3, 6, 6)),
    "batchnorm2d": (lambda: nn.BatchNorm2d(3), (4, 3, 5, 5)),
    "batchnorm1d_2d_input": (lambda: nn.BatchNorm1d(5), (6, 5)),
    "batchnorm1d_3d_input": (lambda: nn.BatchNorm1d(5), (6, 5, 4)),
    "layernorm": (lambda: nn.LayerNorm(5), (4, 3, 5)),
    "layernorm_2d_shape": (lambda: nn.LayerNorm((3, 5)), (4, 3, 5)),
    "maxpool2d": (lambda: nn.MaxPool2d(2), (2, 3, 6, 6)),
    "adaptive_avgpool2d": (lambda: nn.AdaptiveAvgPool2d(1), (2, 3, 5, 5)),
    "avgpool1d": (lambda: nn.AvgPool1d(2), (2, 3, 6)),
    "flatten": (lambda: nn.Flatten(), (2, 3, 4)),
    "softmax_dim1": (lambda: nn.Softmax(dim=1), (4, 5)),
    "gelu": (lambda: nn.GELU(), (4, 5)),
}


def _randomize(layer: nn.Module) -> None:
    """Non-default affine parameters and running statistics, so every tensor matters."""
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
        for name, b in layer.named_buffers():
            if name.endswith("running_var"):
                b.uniform_(0.5, 2.0)
            elif name.endswith("running_mean"):
                b.normal_()


# Train and eval differ only for BatchNorm; the other layers run in train mode.
MODES = [(name, True) for name in sorted(LAYERS)] + [
    (name, False) for name in sorted(LAYERS) if name.startswith("batchnorm")
]


@pytest.mark.parametrize("stacked", [False, True], ids=["shared", "stacked"])
@pytest.mark.parametrize("wrap", [False, True], ids=["sequential", "under_vmap"])
@pytest.mark.parametrize(
    ("name", "train"), MODES, ids=[f"{n}-{'train' if t else 'eval'}" for n, t in MODES]
)
def test_fused_layer_equals_separate_layers(
    name: str, train: bool, wrap: bool, stacked: bool
) -> None:
    make, shape = LAYERS[name]
    torch.manual_seed(0)
    layers = [make().double() for _ in range(K)]
    for layer in layers:
        _randomize(layer)
    models = [(Wrap(layer) if wrap else nn.Sequential(layer)).train(train) for layer in layers]
    fused = fusion.fuse(models)
    x = torch.randn(*((K, *shape) if stacked else shape), dtype=torch.float64, requires_grad=True)
    out = fused(x, stacked=stacked)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    x_grad = torch.zeros_like(x)
    for k, model in enumerate(models):
        xk = x.detach()[k] if stacked else x.detach()
        xk.requires_grad_(True)
        ref = model(xk)
        torch.testing.assert_close(out[k], ref, **TOL)
        (ref * weights[k]).sum().backward()
        assert xk.grad is not None
        if stacked:
            x_grad[k] = xk.grad
        else:
            x_grad += xk.grad
        for (pname, p), q in zip(model.named_parameters(), fused.parameters(), strict=True):
            assert q.grad is not None and p.grad is not None
            torch.testing.assert_close(q.grad[k], p.grad, **TOL, msg=pname)
        for (bname, b), q in zip(model.named_buffers(), fused.buffers(), strict=True):
            torch.testing.assert_close(q[k], b, **TOL, msg=bname)  # running statistics
    assert x.grad is not None
    torch.testing.assert_close(x.grad, x_grad, **TOL)


@pytest.mark.parametrize("stacked", [False, True], ids=["shared", "stacked"])
@pytest.mark.parametrize("wrap", [False, True], ids=["sequential", "under_vmap"])
def test_fused_embedding_equals_separate_embeddings(wrap: bool, stacked: bool) -> None:
    torch.manual_seed(0)
    layers = [nn.Embedding(7, 4).double() for _ in range(K)]
    models = [Wrap(layer) if wrap else nn.Sequential(layer) for layer in layers]
    fused = fusion.fuse(models)
    tokens = torch.randint(0, 7, (K, 5, 3) if stacked else (5, 3))
    out = fused(tokens, stacked=stacked)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    for k, layer in enumerate(layers):
        ref = layer(tokens[k] if stacked else tokens)
        torch.testing.assert_close(out[k], ref, **TOL)
        (ref * weights[k]).sum().backward()
        (table,) = fused.parameters()
        assert layer.weight.grad is not None and table.grad is not None
        torch.testing.assert_close(table.grad[k], layer.weight.grad, **TOL)


def test_conv_chain_keeps_hfta_layout_and_stays_equal() -> None:
    """Conv -> BatchNorm -> ReLU -> Conv: the (N, K*C) layout flows between fused layers."""
    torch.manual_seed(0)

    def net() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Conv2d(4, 4, 3, padding=1, groups=2),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16, 3),
        ).double()

    models = [net() for _ in range(K)]
    for kernels in (True, False):
        fused = fusion.fuse(models, kernels=kernels)
        x = torch.randn(5, 2, 4, 4, dtype=torch.float64)
        out = fused(x)
        for k, model in enumerate(models):
            torch.testing.assert_close(out[k], model(x), **TOL)


class ResBlock(nn.Module):
    """The bench's residual block: fused convolutions hand vmap their (N, K*C) layout."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(3)
        self.conv2 = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_residual_block_under_vmap_equals_separate_blocks(train: bool) -> None:
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Conv2d(2, 3, 1), ResBlock()).double().train(train) for _ in range(K)]
    for model in models:
        _randomize(model)
    fused = fusion.fuse(models)
    x = torch.randn(4, 2, 5, 5, dtype=torch.float64)
    out = fused(x)
    out.square().sum().backward()
    for k, model in enumerate(models):
        ref = model(x)
        torch.testing.assert_close(out[k], ref, **TOL)
        ref.square().sum().backward()
        for p, q in zip(model.parameters(), fused.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            torch.testing.assert_close(q.grad[k], p.grad, **TOL)
        for b, q in zip(model.buffers(), fused.buffers(), strict=True):
            torch.testing.assert_close(q[k], b, **TOL)


@pytest.mark.parametrize(
    ("make", "shape"),
    [(lambda: nn.Linear(3, 2), (4, 3)), (lambda: nn.Conv2d(2, 3, 3, padding=1), (2, 2, 4, 4))],
    ids=["linear", "conv2d"],
)
def test_fused_layers_outside_vmap_are_the_stock_layers(
    make: Callable[[], nn.Module], shape: tuple[int, ...]
) -> None:
    """Called on one model's weights (no vmap), a fused layer computes the stock operator."""
    torch.manual_seed(0)
    stock = make().double()
    fused_layer: nn.Module
    if isinstance(stock, nn.Linear):
        fused_layer = fusion.FusedLinear(stock)
    else:
        assert isinstance(stock, nn.Conv2d)
        fused_layer = fusion.FusedConv(stock)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    out = fused_layer(x)
    out.square().sum().backward()
    grads = [x.grad, *(p.grad for p in stock.parameters())]
    x.grad = None
    stock.zero_grad()
    ref = stock(x)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref, **TOL)
    for got, want in zip(grads, [x.grad, *(p.grad for p in stock.parameters())], strict=True):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("stacked", [False, True], ids=["shared", "stacked"])
@pytest.mark.parametrize("wrap", [False, True], ids=["sequential", "under_vmap"])
def test_a_fused_linear_hands_its_weight_gradient_over_without_a_copy(
    wrap: bool, stacked: bool
) -> None:
    """The weight's gradient comes out in the parameter's ``(K, out, in)`` layout, so autograd
    keeps it as it is: no allocation and copy into that layout (two kernels per layer on a GPU,
    each step)."""
    torch.manual_seed(0)
    models = [(Wrap(nn.Linear(6, 5)) if wrap else nn.Sequential(nn.Linear(6, 5))) for _ in range(K)]
    fused = fusion.fuse(models)
    x = torch.randn(*((K, 4, 2, 6) if stacked else (4, 2, 6)))

    def step() -> None:
        fused.zero_grad(set_to_none=True)
        fused(x, stacked=stacked).square().sum().backward()

    step()
    counts = count_ops(step).by_op
    assert "aten.copy_.default" not in counts, counts
    assert "aten.new_empty_strided.default" not in counts, counts


@pytest.mark.parametrize("wrap", [False, True], ids=["sequential", "under_vmap"])
def test_a_fused_linear_is_twice_differentiable(wrap: bool) -> None:
    """Its backward is itself differentiable (a gradient penalty, double backward)."""
    torch.manual_seed(0)
    layers = [nn.Linear(3, 2).double() for _ in range(K)]
    fused = fusion.fuse([Wrap(layer) if wrap else nn.Sequential(layer) for layer in layers])
    x = torch.randn(K, 4, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda x: fused(x, stacked=True).tanh(), (x,))
