"""A fused training step never reads a device tensor on the host (no stream sync on CUDA).

On the CPU the models live on the ``meta`` device, which stands in for a GPU: its tensors have
no data, so any host read of one (``.item()``, ``.tolist()``, ``bool()``, ``float()``,
``nonzero``...) fails, while host tensors (the hyperparameters' pinned copies) stay readable.
:class:`HostReads` also names every such read before it runs. On a GPU the same step runs under
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
import torch.nn.functional as F
from torch.optim import lr_scheduler
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from waterwave_hpo import fusion

_READS = frozenset(
    {
        "item",
        "tolist",
        "numpy",
        "__bool__",
        "__float__",
        "__int__",
        "__index__",
        "__complex__",
        "nonzero",
        "argwhere",
        "masked_select",
        "unique",
        "equal",
        "allclose",
    }
)
"""Tensor methods and functions that copy device values to the host, or whose output shape
depends on them (``nonzero``): each waits for the device."""


class HostReads(TorchFunctionMode):
    """Records every host read of a tensor that is not on the CPU, with the call's name."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = getattr(func, "__name__", str(func))
        if name in _READS:
            leaves = pytree.tree_leaves((args, kwargs or {}))
            devices = {x.device.type for x in leaves if isinstance(x, torch.Tensor)}
            if devices - {"cpu"}:
                self.reads.append(name)
                raise AssertionError(f"host read of a device tensor in a fused step: {name}")
        return func(*args, **(kwargs or {}))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 10),
        nn.Dropout(0.1),
    )


class Residual(nn.Module):
    """Not a Sequential: runs under vmap, with LayerNorm and a residual branch."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = cnn()
        self.norm = nn.LayerNorm(10)
        self.head = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.inner(x))
        out: torch.Tensor = h + self.head(h)
        return out


Setup = tuple[type[torch.optim.Optimizer], list[dict[str, Any]], Callable[..., Any]]

SETUPS: dict[str, Setup] = {
    # OneCycleLR cycles SGD's momentum every step: the fused SGD once read its Nesterov flags
    # back from the device on every such change.
    "sgd-onecycle": (
        torch.optim.SGD,
        [
            {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4},
            {"lr": 0.05, "momentum": 0.8},
            {"lr": 0.01, "momentum": 0.0, "maximize": True},
        ],
        lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10),
    ),
    "sgd-cyclic": (
        torch.optim.SGD,
        [{"lr": 0.1, "momentum": 0.9}, {"lr": 0.05, "momentum": 0.9}, {"lr": 0.1, "momentum": 0.5}],
        lambda o: lr_scheduler.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2),
    ),
    "adam-onecycle": (
        torch.optim.Adam,
        [{"lr": 1e-3, "amsgrad": True}, {"lr": 1e-2, "weight_decay": 0.01}, {"lr": 1e-3}],
        lambda o: lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=10),
    ),
    "adamw-step": (
        torch.optim.AdamW,
        [{"lr": 1e-3}, {"lr": 1e-2, "betas": (0.8, 0.99)}, {"lr": 1e-3, "maximize": True}],
        lambda o: lr_scheduler.StepLR(o, step_size=1, gamma=0.9),
    ),
}


def _train(device: torch.device, build: Callable[[], nn.Module], setup: Setup, steps: int) -> None:
    """Fuse three models, then run ``steps`` fused training steps, the last ones watched."""
    cls, hparams, schedule = setup
    torch.manual_seed(0)
    fused = fusion.fuse([build().to(device) for _ in range(3)])
    opt = fusion.optimizer(cls, fused, hparams)
    sched = fusion.PerModelScheduler(opt, schedule)
    x = torch.randn(8, 1, 8, 8, device=device)
    y = torch.randint(0, 10, (8,), device=device)
    per_model_max_norm = [1.0, 2.0, 0.5]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = fusion.per_model_loss(F.cross_entropy, fused(x), y).sum()
        loss.backward()
        fusion.clip_grad_norm_(fused, per_model_max_norm)
        opt.step()
        sched.step()

    step()  # the first step creates the optimizer's state
    for _ in range(steps):
        step()


@pytest.mark.parametrize("build", [cnn, Residual], ids=["sequential", "vmap"])
@pytest.mark.parametrize("setup", list(SETUPS), ids=list(SETUPS))
def test_a_fused_step_reads_no_device_tensor_on_the_host(
    build: Callable[[], nn.Module], setup: str
) -> None:
    reads = HostReads()
    with reads:
        _train(torch.device("meta"), build, SETUPS[setup], steps=3)
    assert reads.reads == []


@pytest.mark.gpu
@pytest.mark.parametrize("build", [cnn, Residual], ids=["sequential", "vmap"])
@pytest.mark.parametrize("setup", list(SETUPS), ids=list(SETUPS))
def test_a_fused_step_on_a_gpu_runs_clean_under_sync_debug_mode_error(
    build: Callable[[], nn.Module], setup: str
) -> None:
    device = torch.device("cuda")
    cls, hparams, schedule = SETUPS[setup]
    torch.manual_seed(0)
    fused = fusion.fuse([build().to(device) for _ in range(3)])
    opt = fusion.optimizer(cls, fused, hparams)
    sched = fusion.PerModelScheduler(opt, schedule)
    x = torch.randn(8, 1, 8, 8, device=device)
    y = torch.randint(0, 10, (8,), device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        fusion.per_model_loss(F.cross_entropy, fused(x), y).sum().backward()
        fusion.clip_grad_norm_(fused, [1.0, 2.0, 0.5])
        opt.step()
        sched.step()

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
