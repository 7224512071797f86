"""A fused training step runs as many ATen operations whatever K."""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from waterwave_hpo import bench
from waterwave_hpo import fusion


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _fused_step_ops(k: int) -> int:
    fused = fusion.fuse([_mlp() for _ in range(k)])
    opt = torch.optim.SGD(fused.parameters(), lr=0.1, foreach=True)
    x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        (F.cross_entropy(fused(x).flatten(0, 1), y.repeat(k)) * k).backward()
        opt.step()

    step()
    return bench.count_ops(step).total


def test_fused_step_op_count_does_not_grow_with_k() -> None:
    assert _fused_step_ops(2) == _fused_step_ops(8) > 0


def test_counter_sees_backward_and_counts_each_op() -> None:
    w = torch.randn(3, 3, requires_grad=True)
    counted = bench.count_ops(lambda: (w @ w).sum().backward())
    assert counted.by_op.get("aten.mm.default", 0) >= 3  # one forward, two backward
    assert counted.total == sum(counted.by_op.values()) >= counted.compute
