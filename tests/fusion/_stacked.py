"""K stock models and their parameters stacked to (K, ...): what the fused optimizer is tested on.

Independent of fusion.fuse: the parameters are stacked with torch.func.stack_module_state and
run with vmap(functional_call), so these tests check the optimizer alone.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.func import functional_call
from torch.func import stack_module_state
from torch.func import vmap

IN_FEATURES = 8
CLASSES = 3
BATCH = 16


def make_models(num_models: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [
        nn.Sequential(nn.Linear(IN_FEATURES, 12), nn.Tanh(), nn.Linear(12, CLASSES))
        for _ in range(num_models)
    ]


class Stacked(nn.Module):
    """The models' parameters as (K, ...) Parameters, run as one with vmap; has num_models."""

    def __init__(self, models: list[nn.Module]) -> None:
        super().__init__()
        params, _ = stack_module_state(models)  # type: ignore[arg-type]
        self.names = list(params)
        self.stacked = nn.ParameterList(
            nn.Parameter(params[n].detach().clone()) for n in self.names
        )
        # in a list, so the meta-device copy is not a submodule (its parameters are not ours)
        self.base = [copy.deepcopy(models[0]).to("meta")]
        self.num_models = len(models)

    def forward(self, xs: torch.Tensor) -> torch.Tensor:  # xs: (K, B, F) -> (K, B, C)
        def one(params: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
            return functional_call(self.base[0], dict(zip(self.names, params, strict=True)), (x,))

        return vmap(one)(tuple(self.stacked), xs)

    def model_params(self, k: int) -> dict[str, torch.Tensor]:
        return {n: p[k].detach() for n, p in zip(self.names, self.stacked, strict=True)}

    def keep(self, indices: list[int]) -> None:
        """What fused.keep_models does to the parameters: re-stack .data to (K', ...)."""
        for p in self.stacked:
            p.data = p.data[indices].clone()
            if p.grad is not None:
                p.grad = p.grad[indices].clone()
        self.num_models = len(indices)


def batches(num_models: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Model k's batch at this step: xs (K, B, F), ys (K, B); the same for the stock run."""
    gen = torch.Generator().manual_seed(1000 + step)
    xs = torch.randn(num_models, BATCH, IN_FEATURES, generator=gen)
    ys = torch.randint(0, CLASSES, (num_models, BATCH), generator=gen)
    return xs, ys


def fused_loss(stacked: Stacked, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """Sum over models of each model's mean loss, so model k's gradient is its own."""
    out = stacked(xs)
    losses = nn.functional.cross_entropy(out.flatten(0, 1), ys.flatten(), reduction="none").view(
        ys.shape
    )
    return losses.mean(dim=1).sum()
