"""Property: for any per-model hyperparameters the stock class accepts, model k of the fused
optimizer takes the steps the stock optimizer takes (same tolerance as test_optim.py).

Plain tensors with given gradients, no model: hypothesis draws K, each model's hyperparameters
(including edge values: zero momentum with dampening, Nesterov, betas near 1, AMSGrad,
maximize) and the gradients.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import torch
from torch import nn

from waterwave_hpo import fusion

SHAPES = ((5, 3), (3,))
STEPS = 4


def _sgd() -> st.SearchStrategy[dict[str, Any]]:
    momentum = st.sampled_from([0.0, 0.5, 0.9, 0.99])
    return st.fixed_dictionaries(
        {"lr": st.floats(1e-4, 1.0), "weight_decay": st.sampled_from([0.0, 1e-4, 0.1])},
        optional={"maximize": st.booleans()},
    ).flatmap(
        lambda d: momentum.flatmap(
            lambda m: st.one_of(
                st.just({**d, "momentum": m, "dampening": 0.0, "nesterov": m > 0}),
                st.just({**d, "momentum": m, "dampening": 0.3}),
            )
        )
    )


def _adam() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {
            "lr": st.floats(1e-5, 1e-1),
            "betas": st.tuples(st.sampled_from([0.0, 0.5, 0.9]), st.sampled_from([0.9, 0.999])),
            "eps": st.sampled_from([1e-8, 1e-6, 1e-3]),
            "weight_decay": st.sampled_from([0.0, 1e-2, 0.5]),
            "amsgrad": st.booleans(),
            "maximize": st.booleans(),
        }
    )


CASES = st.one_of(
    st.tuples(st.just(torch.optim.SGD), st.lists(_sgd(), min_size=1, max_size=4)),
    st.tuples(
        st.sampled_from([torch.optim.Adam, torch.optim.AdamW]),
        st.lists(_adam(), min_size=1, max_size=4),
    ),
)


@settings(max_examples=60, deadline=None)
@given(case=CASES, seed=st.integers(0, 2**16))
def test_model_k_steps_as_the_stock_optimizer_with_its_hyperparameters(
    case: tuple[type[torch.optim.Optimizer], list[dict[str, Any]]], seed: int
) -> None:
    cls, hparams = case
    num_models = len(hparams)
    gen = torch.Generator().manual_seed(seed)
    fused = [nn.Parameter(torch.randn((num_models, *s), generator=gen)) for s in SHAPES]
    singles = [[nn.Parameter(p[k].detach().clone()) for p in fused] for k in range(num_models)]
    opt = fusion.optimizer(cls, fused, hparams)
    stock = [cls(ps, **hp) for ps, hp in zip(singles, hparams, strict=True)]
    for _ in range(STEPS):
        for p in fused:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        for k, o in enumerate(stock):
            for p, q in zip(singles[k], fused, strict=True):
                p.grad = q.grad[k].clone()  # type: ignore[index]
            o.step()
    for k in range(num_models):
        for p, q in zip(singles[k], fused, strict=True):
            torch.testing.assert_close(q[k].detach(), p.detach(), rtol=1e-4, atol=1e-6)
