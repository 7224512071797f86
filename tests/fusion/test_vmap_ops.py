"""A model that runs whole under vmap (not traceable): its fused step's ATen operations.

Hugging Face BERT does not trace with torch.fx (its forward does arithmetic on
``input_ids.size()``), so its fused forward runs under ``torch.func.vmap`` with Linear as a
fused kernel and dropout drawing the K masks at once.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
import torch.nn.functional as F

from waterwave_hpo import fusion
from waterwave_hpo.bench import count_ops


class Untraceable(nn.Module):
    """Branches on its input's shape, as BERT does: torch.fx cannot trace it, vmap runs it."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 1:
            x = x.unsqueeze(0)
        return self.layer(x)  # type: ignore[no-any-return]


class TinyBert(nn.Module):
    """A 2-layer, 32-wide BERT classifier returning its logits."""

    def __init__(self) -> None:
        super().__init__()
        import transformers as hf

        config = hf.BertConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            num_labels=10,
        )
        self.bert = hf.BertForSequenceClassification(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids).logits  # type: ignore[no-any-return]


def _step_ops(k: int) -> tuple[int, int]:
    """ATen operations of one training step (SGD): (one model, the K fused)."""
    torch.manual_seed(0)
    models = [TinyBert().train() for _ in range(k)]
    x = torch.randint(0, 64, (4, 8))
    y = torch.randint(0, 10, (4,))
    one = copy.deepcopy(models[0])
    one_opt = torch.optim.SGD(one.parameters(), lr=0.01, foreach=True)
    fused = fusion.fuse(models)
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
    fused_step()  # warm-up: optimizer state, the dropout factors
    return count_ops(single).total, count_ops(fused_step).total


def test_a_fused_bert_step_runs_at_most_one_and_a_half_models_operations() -> None:
    # Before: 1.70x one model's operations (a permute around every fused Linear for the
    # models' dimension already in front, and each dropout's rate arithmetic per step).
    one, fused_2 = _step_ops(2)
    _, fused_4 = _step_ops(4)
    assert fused_2 == fused_4
    assert fused_4 <= 1.5 * one, (fused_4, one)


def test_a_fused_bert_matches_each_model_alone_outputs_and_gradients() -> None:
    torch.manual_seed(0)
    models = [TinyBert().train() for _ in range(3)]
    result = fusion.verify(fusion.fuse(models), torch.randint(0, 64, (4, 8)))
    assert result.output_error <= 2e-4 and result.gradient_error <= 1e-2, result


def test_dropout_under_vmap_passes_each_models_mask_to_the_gradient() -> None:
    rates = [0.0, 0.5, 0.9]
    fused = fusion.fuse([Untraceable(nn.Sequential(nn.Dropout(p))) for p in rates])
    x = torch.ones(50, 40, requires_grad=True)
    out = fused(x)
    out.sum().backward()
    # d(sum of the K outputs)/dx is the sum of the K masks' factors: the outputs at x = 1.
    assert x.grad is not None
    torch.testing.assert_close(x.grad, out.detach().sum(0))
    for k, p in enumerate(rates):
        assert abs((out[k] == 0).float().mean().item() - p) < 0.05


def test_a_fused_linear_under_vmap_adds_no_permute() -> None:
    fused = fusion.fuse([Untraceable(nn.Linear(8, 4)) for _ in range(3)])
    x = torch.randn(3, 5, 8, requires_grad=True)
    fused(x, stacked=True).sum().backward()  # warm-up
    counts = count_ops(lambda: fused(x, stacked=True).sum().backward())
    assert "aten.permute.default" not in counts.by_op, counts.by_op


def test_dropout_under_vmap_runs_one_models_operations_at_every_k() -> None:
    # Before: the K rates' arithmetic (keep = 1 - rate, its reciprocal, the zero guard) ran
    # batched at every step: 2.4 times one dropout's operations.
    x = torch.randn(5, 8, requires_grad=True)
    one = Untraceable(nn.Dropout(0.1))

    def fused_ops(k: int) -> int:
        fused = fusion.fuse([Untraceable(nn.Dropout(0.1)) for _ in range(k)])
        xs = torch.randn(k, 5, 8, requires_grad=True)
        fused(xs, stacked=True).sum().backward()  # warm-up: the rates' factors, once
        return count_ops(lambda: fused(xs, stacked=True).sum().backward()).total

    counts = [fused_ops(2), fused_ops(8)]
    alone = count_ops(lambda: one(x).sum().backward()).total
    assert counts[0] == counts[1] <= alone, (counts, alone)
