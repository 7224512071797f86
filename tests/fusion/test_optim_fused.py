"""fusion.optimizer on a real fusion.fuse module: the executor's path, end to end.

Same tolerance as test_optim.py (rtol=1e-4, atol=1e-6, float32; see there why not bit-exact).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler

from fusion._stacked import batches
from fusion._stacked import make_models
from waterwave_hpo import fusion


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.AdamW])
def test_fused_module_trained_with_fused_optimizer_equals_stock_training_after_pruning(
    cls: type[torch.optim.Optimizer],
) -> None:
    hparams = (
        [{"lr": 0.1 * (k + 1), "momentum": 0.9, "nesterov": k == 1} for k in range(3)]
        if cls is torch.optim.SGD
        else [{"lr": 1e-2 / (k + 1), "weight_decay": 0.05 * k, "amsgrad": k == 2} for k in range(3)]
    )
    gammas = [0.9, 0.8, 0.7]
    stock = make_models(3, seed=5)
    fused = fusion.fuse(stock)
    opt = fusion.optimizer(cls, fused, hparams)
    sched = fusion.PerModelScheduler(
        opt, [lambda o, g=g: lr_scheduler.ExponentialLR(o, gamma=g) for g in gammas]
    )
    opts = [cls(m.parameters(), **hp) for m, hp in zip(stock, hparams, strict=True)]
    scheds = [lr_scheduler.ExponentialLR(o, gamma=g) for o, g in zip(opts, gammas, strict=True)]
    alive = [0, 1, 2]
    for step in range(8):
        if step == 4:  # model 1 is pruned: it leaves the array
            alive = [0, 2]
            fused.keep_models([0, 2])
            opt.keep_models([0, 2])
        xs, ys = batches(1, step)  # one batch shared by the models
        opt.zero_grad(set_to_none=True)
        losses = fusion.per_model_loss(nn.functional.cross_entropy, fused(xs[0]), ys[0])
        losses.sum().backward()
        opt.step()
        sched.step()
        for k in alive:
            opts[k].zero_grad()
            nn.functional.cross_entropy(stock[k](xs[0]), ys[0]).backward()
            opts[k].step()
            scheds[k].step()
    assert sched.get_last_lr() == [scheds[0].get_last_lr()[0], scheds[2].get_last_lr()[0]]
    for trained, k in zip(fused.unfuse(), alive, strict=True):
        for (name, got), want in zip(
            trained.named_parameters(), stock[k].parameters(), strict=True
        ):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=name)
