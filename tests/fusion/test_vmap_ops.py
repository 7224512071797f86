"""A model that runs whole under vmap (not traceable): its fused step's ATen operations.

Hugging Face BERT does not trace with torch.fx (its forward does arithmetic on
``input_ids.size()``), so its fused forward runs under ``torch.func.vmap`` with Linear as a
fused kernel and dropout drawing the K masks at once.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from waterwave_hpo import fusion
from waterwave_hpo.bench import OpCount
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


def _step_counts(
    k: int, cls: type[torch.optim.Optimizer] = torch.optim.SGD, per_model: bool = False
) -> tuple[OpCount, OpCount]:
    """ATen operations of one training step: (one model's, the K fused models').

    One model: the stock optimizer ``cls`` (``foreach=True``). Fused: one flat cross-entropy
    over the K models' rows, then ``cls`` over the stacked parameters (one learning rate), or
    with ``per_model``, ``fusion.optimizer`` with each model's own learning rate (a search).
    """
    torch.manual_seed(0)
    models = [TinyBert().train() for _ in range(k)]
    x = torch.randint(0, 64, (4, 8))
    y = torch.randint(0, 10, (4,))
    lrs = [1e-3 * (i + 1) for i in range(k)]
    one = copy.deepcopy(models[0])
    one_opt = cls(one.parameters(), lr=lrs[0], foreach=True)
    fused = fusion.fuse(models)
    fused_opt = (
        fusion.optimizer(cls, fused, [{"lr": lr} for lr in lrs])
        if per_model
        else cls(fused.parameters(), lr=lrs[0], foreach=True)
    )

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
    return count_ops(single), count_ops(fused_step)


def _kernels(count: OpCount) -> int:
    """Operations that launch kernels on a GPU: not views, not a read of a CPU scalar.

    torch's foreach Adam reads each parameter's step count, a CPU tensor, on the host
    (``_local_scalar_dense``, one per parameter): no kernel on a GPU either. A foreach
    operation counts once (on a GPU it launches a kernel per group of tensors).
    """
    return count.compute - count.by_op.get("aten._local_scalar_dense.default", 0)


def test_a_fused_bert_step_runs_at_most_1_3_times_one_models_operations() -> None:
    # Before: 1.70x one model's operations (a permute around every fused Linear for the
    # models' dimension already in front, and each dropout's rate arithmetic per step), then
    # 1.34x (each fused Linear's weight gradient copied into the parameter's layout).
    one, fused_2 = _step_counts(2)
    _, fused_4 = _step_counts(4)
    assert fused_2.total == fused_4.total
    assert fused_4.total <= 1.3 * one.total, (fused_4.total, one.total)
    assert _kernels(fused_4) <= 1.2 * _kernels(one), (fused_4.by_op, one.by_op)


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.AdamW])
def test_a_fused_bert_search_step_with_per_model_values_runs_about_one_models_operations(
    cls: type[torch.optim.Optimizer],
) -> None:
    # Before: the fused optimizer stepped each stacked parameter on its own, with the K
    # values broadcast: 1.5x (SGD) and 3.3x (AdamW) one model's operations, growing with the
    # number of parameters. Now a fixed few foreach operations over all the parameters.
    one, fused_2 = _step_counts(2, cls, per_model=True)
    _, fused_4 = _step_counts(4, cls, per_model=True)
    assert fused_2.total == fused_4.total
    assert _kernels(fused_4) <= 1.2 * _kernels(one), (fused_4.by_op, one.by_op)
    # The views (no kernel) include one per parameter: its gradient's K slices.
    assert fused_4.total <= 1.35 * one.total, (fused_4.total, one.total)


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
