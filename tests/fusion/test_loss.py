"""fusion.per_model_loss: one loss per model; one backward gives each model its own gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from waterwave_hpo import fusion


def test_each_loss_is_that_models_loss_shared_and_stacked_targets() -> None:
    outputs = torch.randn(3, 5, 4)
    shared = torch.randint(0, 4, (5,))
    losses = fusion.per_model_loss(nn.CrossEntropyLoss(), outputs, shared)
    assert losses.shape == (3,)
    for k in range(3):
        torch.testing.assert_close(losses[k], F.cross_entropy(outputs[k], shared))
    per_model = torch.randn(3, 5, 4)
    losses = fusion.per_model_loss(F.mse_loss, outputs, per_model)
    for k in range(3):
        torch.testing.assert_close(losses[k], F.mse_loss(outputs[k], per_model[k]))


def test_summed_backward_gives_each_model_only_its_own_gradient() -> None:
    outputs = torch.randn(3, 5, 4, requires_grad=True)
    target = torch.randint(0, 4, (5,))
    fusion.per_model_loss(F.cross_entropy, outputs, target).sum().backward()
    for k in range(3):
        alone = outputs.detach()[k].clone().requires_grad_(True)
        F.cross_entropy(alone, target).backward()
        assert outputs.grad is not None
        torch.testing.assert_close(outputs.grad[k], alone.grad)


def test_ambiguous_target_asks_for_target_stacked() -> None:
    outputs = torch.randn(4, 4, 4)  # K = B = C = 4: a (4, 4) target reads both ways
    target = torch.rand(4, 4)
    with pytest.raises(
        ValueError,
        match=r"target.shape=\(4, 4\): reads as one target per model and as one shared "
        r"target.*pass target_stacked=True or False",
    ):
        fusion.per_model_loss(F.cross_entropy, outputs, target)
    as_probs = fusion.per_model_loss(F.cross_entropy, outputs, target, target_stacked=False)
    torch.testing.assert_close(as_probs[1], F.cross_entropy(outputs[1], target))


def test_bad_inputs_are_named() -> None:
    outputs = torch.randn(3, 5, 4)
    with pytest.raises(TypeError, match="loss_fn=1: must be callable"):
        fusion.per_model_loss(1, outputs, torch.zeros(5))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"target.shape=\(2, 5\): must start with K=3"):
        fusion.per_model_loss(F.mse_loss, outputs, torch.zeros(2, 5), target_stacked=True)
    with pytest.raises(
        ValueError, match=r"must return a scalar per model, got \(5,\) for K=3.*reduction='mean'"
    ):
        fusion.per_model_loss(
            nn.CrossEntropyLoss(reduction="none"), outputs, torch.zeros(5, dtype=torch.long)
        )
