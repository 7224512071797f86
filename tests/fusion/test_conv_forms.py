"""The two forms of K fused 2-d convolutions, and the one-time choice between them.

The choice is made by timing, so a test that wants one form sets it (``_choose`` replaced) rather
than hoping the machine picks it; no test asserts which form is faster.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from waterwave_hpo import fusion
from waterwave_hpo.fusion import _conv_forms

K = 3
TOL = {"rtol": 1e-9, "atol": 1e-9}


@pytest.mark.parametrize(
    ("conv", "size"),
    [
        (lambda: nn.Conv2d(4, 6, 3, padding=1), (5, 5)),
        (lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1, bias=False), (7, 6)),
        (lambda: nn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(0, 1), dilation=2), (9, 8)),
        (lambda: nn.Conv2d(8, 4, 1, stride=2, bias=False), (4, 4)),
        (lambda: nn.Conv2d(8, 8, 3, padding=1), (1, 1)),  # one pixel: ResNet's last stage
    ],
)
def test_the_batched_matmul_form_equals_the_grouped_convolution(conv: object, size: tuple) -> None:
    torch.manual_seed(0)
    layers = [conv().double() for _ in range(K)]  # type: ignore[operator]
    fused = fusion.fuse(layers)
    layer = fused.stacked
    assert isinstance(layer, fusion.FusedConv)
    x = torch.randn(2, K * layer.in_channels, *size, dtype=torch.float64, requires_grad=True)
    geometry = (tuple(layer.stride), tuple(layer.padding), tuple(layer.dilation), 1)
    outputs, grads = [], []
    for form in (_conv_forms.grouped, _conv_forms.batched_matmul):
        x.grad = None
        fused.zero_grad()
        y = form(x, layer.weight, layer.bias, K, geometry)
        y.square().sum().backward()
        outputs.append(y)
        grads.append([x.grad, *(p.grad for p in layer.parameters())])
    torch.testing.assert_close(outputs[1], outputs[0], **TOL)
    for mine, reference in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(mine, reference, **TOL)


def cnn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 3 * 3, 2),
    )


def test_a_model_run_in_the_chosen_form_equals_each_model_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []

    def choose(*args: object) -> str:
        calls.append(args[0].shape)  # type: ignore[attr-defined]
        return _conv_forms.BATCHED_MATMUL

    monkeypatch.setattr(_conv_forms, "_choose", choose)
    models = [cnn(seed).double() for seed in range(K)]
    fused = fusion.fuse([copy.deepcopy(m) for m in models])
    x = torch.randn(K, 5, 3, 5, 5, dtype=torch.float64)
    for _ in range(2):
        out = fused(x, stacked=True)
        out.square().sum().backward()
    # The first layer reads each model's own batch (not shared): both convolutions take the
    # chosen form, each chosen once for its one input shape.
    second = fused.stacked[3]
    assert isinstance(second, fusion.FusedConv)
    assert list(second.forms.values()) == [_conv_forms.BATCHED_MATMUL]
    assert len(calls) == 2
    for k, model in enumerate(models):
        mine = model(x[k])
        torch.testing.assert_close(out[k], mine, **TOL)
        mine.square().sum().backward()
        mine = model(x[k])  # the second step, as the fused one ran two
        mine.square().sum().backward()
        for name, param in fused.stacked.named_parameters():
            reference = model.get_parameter(name).grad
            assert param.grad is not None and reference is not None
            torch.testing.assert_close(param.grad[k], reference, **TOL)


class CountCalls(TorchDispatchMode):
    """Stands in for an operation counter: a dispatch mode active while the step runs."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def test_nothing_is_timed_under_autotune_false_or_a_dispatch_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def choose(*args: object) -> str:
        raise AssertionError("timed")

    monkeypatch.setattr(_conv_forms, "_choose", choose)
    fused = fusion.fuse([cnn(seed) for seed in range(K)])
    x = torch.randn(K, 5, 3, 5, 5)
    with CountCalls():
        fused(x, stacked=True).sum().backward()
    for module in fused.modules():
        if isinstance(module, fusion.FusedConv):
            assert module.forms == {}  # the choice stays open for the first real step
            module.autotune = False
    fused(x, stacked=True).sum().backward()
