"""A fused model whose forward is a graph (residual blocks) runs on HFTA's layout.

Contracts: every model's outputs, gradients and BatchNorm statistics equal its own, in train
and eval mode, shared or stacked inputs; a forward with anything else still fuses (whole
under vmap); one fused training step runs at most 1.5 times one model's ATen operations
(about one kernel launch each on a GPU), the same at every K.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from waterwave_hpo import fusion
from waterwave_hpo.bench import count_ops
from waterwave_hpo.fusion import _conv_forms


class Block(nn.Module):
    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels * stride, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels * stride)
        self.conv2 = nn.Conv2d(channels * stride, channels * stride, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels * stride)
        self.down = (
            nn.Sequential(nn.Conv2d(channels, channels * stride, 1, stride), nn.BatchNorm2d(8))
            if stride > 1
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.down is None else self.down(x)
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        y += shortcut
        return torch.relu(y)


class ResNetLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.blocks = nn.Sequential(Block(4, 1), Block(4, 2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(0.0)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.relu(self.bn(self.stem(x)))
        x = self.blocks(x)
        return self.fc(self.drop(torch.flatten(self.pool(x), 1)))


class ReadsAView(ResNetLike):
    """A forward with a tensor method (``view``): not run on the layout, run under vmap."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.bn(self.stem(x))))
        return self.fc(self.pool(x).view(x.shape[0], -1))


class AddsTheInput(nn.Module):
    """Adds the (shared) input to a convolution's output: two layouts meet."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x) + x) * 2.0


class Aliases(nn.Module):
    """``z += 1`` changes ``y`` too (one tensor): the fused forward must keep that."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        z = y
        z += 1.0
        return y * z


def _models(build: type[nn.Module], k: int) -> list[nn.Module]:
    torch.manual_seed(0)
    models = [build() for _ in range(k)]
    for model in models:  # non-trivial running statistics and affine parameters
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                nn.init.uniform_(module.weight, 0.5, 1.5)
                nn.init.uniform_(module.bias, -0.5, 0.5)
    return models


@pytest.mark.parametrize("build", [ResNetLike, ReadsAView, AddsTheInput, Aliases])
@pytest.mark.parametrize("stacked", [False, True])
def test_each_fused_model_computes_its_own_function_and_gradients(
    build: type[nn.Module], stacked: bool
) -> None:
    k = 3
    # float64: the fused step sums in another order (one grouped convolution), so float32
    # differs by rounding that LayerNorm's backward amplifies; float64 shows the function
    models = [m.double() for m in _models(build, k)]
    alone = [copy.deepcopy(m) for m in models]
    fused = fusion.fuse(models)
    shape = (k, 4, 3, 8, 8) if stacked else (4, 3, 8, 8)
    x = torch.randn(shape, dtype=torch.float64)
    for mode in ("train", "eval", "train"):
        fused.train(mode == "train")
        out = fused(x, stacked=stacked)
        out.pow(2).sum().backward()
        for i, model in enumerate(alone):
            model.train(mode == "train")
            expected = model(x[i] if stacked else x)
            expected.pow(2).sum().backward()
            torch.testing.assert_close(out[i], expected)
    for i, model in enumerate(fused.unfuse()):
        for (name, a), b in zip(
            model.state_dict().items(), alone[i].state_dict().values(), strict=True
        ):
            torch.testing.assert_close(a, b, msg=name)
    for name, param in fused.stacked.named_parameters():
        for i, model in enumerate(alone):
            grad = model.get_parameter(name).grad
            assert param.grad is not None and grad is not None
            torch.testing.assert_close(param.grad[i], grad, msg=name)


def _step_ops(build: type[nn.Module], k: int, *, autotune: bool = False) -> tuple[int, int]:
    """ATen operations of one training step: (one model, the K fused).

    With ``autotune`` False every fused convolution is grouped (as on CUDA), so the count does
    not depend on which form a timing on this machine would choose.
    """
    models = _models(build, k)
    x = torch.randn(8, 3, 8, 8)
    y = torch.randint(0, 10, (8,))
    one = copy.deepcopy(models[0])
    one_opt = torch.optim.SGD(one.parameters(), lr=0.01, foreach=True)
    fused = fusion.fuse(models)
    for module in fused.modules():
        if isinstance(module, fusion.FusedConv):
            module.autotune = autotune
    fused_opt = torch.optim.SGD(fused.parameters(), lr=0.01, foreach=True)

    def single() -> None:
        one_opt.zero_grad(set_to_none=True)
        F.cross_entropy(one(x), y).backward()
        one_opt.step()

    def fused_step() -> None:
        fused_opt.zero_grad(set_to_none=True)
        (F.cross_entropy(fused(x).flatten(0, 1), y.repeat(k)) * k).backward()
        fused_opt.step()

    single()
    fused_step()  # warm-up: optimizer state, the traced graph
    return count_ops(single).total, count_ops(fused_step).total


def test_a_fused_step_runs_about_one_models_operations_at_every_k() -> None:
    # Before: the whole forward ran under vmap, which wrapped every convolution and
    # BatchNorm in reshapes, permutes and copies (timm resnet18: 4.5 times one model's ops).
    one, fused_4 = _step_ops(ResNetLike, 4)
    _, fused_8 = _step_ops(ResNetLike, 8)
    assert fused_4 == fused_8
    assert fused_4 <= 1.5 * one, (fused_4, one)


def test_the_batched_matmul_form_keeps_the_count_flat_in_k(monkeypatch: pytest.MonkeyPatch) -> None:
    # The form the CPU may choose per layer (im2col and one bmm) costs more operations than the
    # grouped convolution, but as many at every K.
    monkeypatch.setattr(_conv_forms, "_choose", lambda *args: _conv_forms.BATCHED_MATMUL)
    _, fused_4 = _step_ops(ResNetLike, 4, autotune=True)
    _, fused_8 = _step_ops(ResNetLike, 8, autotune=True)
    _, grouped = _step_ops(ResNetLike, 8)
    assert fused_4 == fused_8 > grouped
