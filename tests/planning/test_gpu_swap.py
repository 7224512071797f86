"""The swap path on a real CUDA device (marked ``gpu``; skipped without CUDA).

On a GPU the host runs ahead, so a swapped activation held until its copy is
*seen* landed stayed allocated through the forward. Measured in reserved bytes with PyTorch's own
allocator: its ``memory_allocated`` drops at the free even while ``record_stream`` keeps the block
for the copy, so only the peak of reserved bytes says whether the swapped blocks were reused
within the forward (what a co-hosted neighbour gains).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import waterwave_hpo as ww
from waterwave_hpo.planning import remove_memory_plan

pytestmark = pytest.mark.gpu


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(2048, 2048), nn.Tanh())])


def _forward_bytes(model: nn.Module, x: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """Peak reserved bytes the forward added (bytes), and the gradients of one step."""
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    loss = model(x).square().mean()  # no synchronize: the host is ahead of the GPU
    held = torch.cuda.max_memory_reserved() - base
    loss.backward()  # type: ignore[no-untyped-call]
    return held, [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_a_swap_plan_frees_the_forwards_activations_while_the_gpu_copies_them() -> None:
    device = torch.device("cuda")
    x = torch.randn(512, 2048, device=device)
    model = _mlp().to(device)
    ww.fit_memory(model, 1 << 40, example_input=x, planner="none")
    keep_bytes, keep_grads = _forward_bytes(model, x)
    remove_memory_plan(model)
    ww.fit_memory(model, 1 << 40, example_input=x, planner="swap_all")
    swap_bytes, swap_grads = _forward_bytes(model, x)
    assert swap_bytes < keep_bytes / 2, (swap_bytes, keep_bytes)
    for a, b in zip(keep_grads, swap_grads, strict=True):  # the swapped-in bytes were awaited
        torch.testing.assert_close(a, b)
