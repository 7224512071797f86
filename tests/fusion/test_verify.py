"""Layers accepted by running them, keyword inputs, and verify() before training."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from waterwave_hpo import fusion

TOL = {"rtol": 1e-4, "atol": 1e-5}


def _equal_to_each(fused: fusion.FusedModule, models: list[nn.Module], *args: object) -> None:
    out = fused(*args)
    for k, model in enumerate(models):
        torch.testing.assert_close(out[k], model(*args), **TOL)


@pytest.mark.parametrize(
    "layer",
    [
        nn.Hardswish(),
        nn.Hardsigmoid(),
        nn.Upsample(scale_factor=2),
        nn.Upsample(scale_factor=2, mode="bilinear"),
        nn.PixelShuffle(2),
        nn.AdaptiveMaxPool2d(3),
        nn.Softmax(dim=1),
        nn.Unflatten(1, (2, 4)),
    ],
    ids=lambda layer: type(layer).__name__,
)
def test_parameter_free_layers_fuse_without_a_list(layer: nn.Module) -> None:
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), layer) for _ in range(3)]
    x = torch.randn(2, 3, 6, 6)
    fused = fusion.fuse(models, example_inputs=x)
    _equal_to_each(fused, models, x)


class Conv3dNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3, padding=1)
        self.norm = nn.BatchNorm3d(4)
        self.pool = nn.MaxPool3d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(F.relu(self.norm(self.conv(x))))  # type: ignore[no-any-return]


def test_conv3d_and_batchnorm3d_fuse_and_match() -> None:
    torch.manual_seed(0)
    models = [Conv3dNet() for _ in range(2)]
    x = torch.randn(2, 2, 4, 4, 4)
    result = fusion.verify(fusion.fuse(models), x)
    assert result.output_error < 1e-5 and result.gradient_error < 1e-4


class TimmStyleAttention(nn.Module):
    """Attention as timm and transformers write it: the dropout rate read as a float."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.attn_drop = nn.Dropout(p)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.attn_drop.p if self.training else 0.0
        )
        return self.proj(out.transpose(1, 2).reshape(b, n, 8))  # type: ignore[no-any-return]


def test_attention_that_reads_its_dropout_rate_fuses() -> None:
    # Once the fused dropout's rate was a tensor here: vmap's .item() crash.
    torch.manual_seed(0)
    models = [TimmStyleAttention().train() for _ in range(2)]
    x = torch.randn(3, 5, 8)
    fused = fusion.fuse(models, example_inputs=x)
    _equal_to_each(fused, models, x)


def test_different_dropout_rates_read_as_a_float_are_refused_with_the_path() -> None:
    models = [nn.Sequential(nn.Linear(8, 8), TimmStyleAttention(p)) for p in (0.1, 0.2)]
    with pytest.raises(fusion.FusionError) as info:
        fusion.fuse(models, example_inputs=torch.randn(3, 5, 8))
    assert info.value.path == "1.attn_drop"  # the layer whose rate the attention reads
    assert "dropout rates [0.1, 0.2] differ" in str(info.value)


def test_multihead_attention_fuses() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x, need_weights=False)[0]  # type: ignore[no-any-return]

    torch.manual_seed(0)
    models = [Block() for _ in range(2)]
    x = torch.randn(2, 4, 8)
    _equal_to_each(fusion.fuse(models, example_inputs=x), models, x)


def test_forward_takes_keyword_inputs_shared_and_stacked() -> None:
    torch.manual_seed(0)
    models = [TimmStyleAttention() for _ in range(2)]
    x = torch.randn(3, 5, 8)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    fused = fusion.fuse(models, example_inputs=x, example_kwargs={"mask": mask})
    out = fused(x, mask=mask)
    stacked = fused(x.expand(2, *x.shape), mask=mask.expand(2, *mask.shape), stacked=True)
    for k, model in enumerate(models):
        torch.testing.assert_close(out[k], model(x, mask=mask), **TOL)
        torch.testing.assert_close(stacked[k], model(x, mask=mask), **TOL)
    with pytest.raises(ValueError, match=r"kwargs\['mask'\]\.shape=\(5, 5\): must start with K=2"):
        fused(x.expand(2, *x.shape), mask=mask, stacked=True)


class ReadsAValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * float(self.linear.weight.sum())


def test_fuse_with_an_example_refuses_what_cannot_run_batched_naming_the_path() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), ReadsAValue()))
    with pytest.raises(fusion.FusionError) as info:
        fusion.fuse([model, copy.deepcopy(model)], example_inputs=torch.randn(2, 4))
    assert info.value.path == "1.1"
    text = str(info.value)
    assert text.startswith("model.1.1=<ReadsAValue>: cannot run batched"), text
    assert ".item()" in info.value.reason


class HiddenState(nn.Module):
    """Keeps a per-model tensor as a plain attribute: fusion cannot see (or stack) it."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = torch.tensor(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale  # type: ignore[no-any-return]


def test_verify_refuses_a_fused_model_that_runs_but_differs() -> None:
    torch.manual_seed(0)
    models = [HiddenState(1.0), HiddenState(3.0)]
    fused = fusion.fuse(models)  # accepted: the structure keys are equal
    with pytest.raises(fusion.FusionError, match=r"^model=<HiddenState>: the fused models do not"):
        fusion.verify(fused, torch.randn(2, 4), models=models)
    with pytest.raises(fusion.FusionError, match=r"an output of model 1 differs by 0.667"):
        fusion.fuse(models, example_inputs=torch.randn(2, 4))


def test_verify_leaves_the_fused_module_and_the_rng_as_they_were() -> None:
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)) for _ in range(2)]
    fused = fusion.fuse(models)
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    x = torch.randn(6, 4)
    rng = torch.get_rng_state()
    fusion.verify(fused, x)
    assert torch.equal(torch.get_rng_state(), rng)
    for key, value in fused.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in fused.parameters())


def test_verify_refuses_an_input_the_model_alone_rejects() -> None:
    fused = fusion.fuse([nn.Linear(4, 2), nn.Linear(4, 2)])
    with pytest.raises(ValueError, match=r"^inputs=.*does not run on model 0 alone"):
        fusion.verify(fused, torch.randn(2, 5))
