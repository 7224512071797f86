"""``laysa(ddp_model, density=..., optimizer=...)``: attach LaySA to a DDP model in one call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from waterwave_hpo import _checks
from waterwave_hpo.distributed._hook import laysa_hook
from waterwave_hpo.distributed._mirror import MirrorWeightUpdate
from waterwave_hpo.distributed._state import LaySAState
from waterwave_hpo.distributed._state import check_density
from waterwave_hpo.distributed._state import check_process_group
from waterwave_hpo.distributed._state import register_comm_hook


@dataclass
class LaySA:
    """What :func:`laysa` attached: the hook's state and the mirror weight update.

    Attributes:
        state: The hook state (``bytes_sent_last_step``, ``ledger``, ``residual(param)``).
        mirror: The mirror weight update on the optimizer.
    """

    state: LaySAState
    mirror: MirrorWeightUpdate

    def state_dict(self) -> dict[str, Any]:
        """The hook's checkpoint (step count and residuals); see :meth:`LaySAState.state_dict`."""
        return self.state.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a checkpoint from :meth:`state_dict` (same model, same parameter order)."""
        self.state.load_state_dict(state_dict)


def laysa(
    ddp_model: DistributedDataParallel,
    density: float = 0.01,
    *,
    optimizer: torch.optim.Optimizer,
    warmup_steps: int = 1,
    process_group: dist.ProcessGroup | None = None,
) -> LaySA:
    """Make a DDP model communicate top-k sparse gradients with LaySA's memory reuse.

    Registers :func:`laysa_hook` as the model's comm hook and the mirror weight update on the
    optimizer. The training loop stays as it is (``zero_grad``, ``backward``, ``step``). At
    ``density=1`` training is exactly dense DDP's. Call once, before the first step.

    Example::

        model = DistributedDataParallel(net)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        laysa(model, density=0.01, optimizer=optimizer)

    Args:
        ddp_model: The ``DistributedDataParallel`` model (gloo or nccl group).
        density: Fraction of each layer's gradient entries sent per step, in (0, 1].
        optimizer: The optimizer of every parameter of ``ddp_model`` that needs a gradient.
        warmup_steps: Dense steps first (>= 1).
        process_group: The DDP model's group (``None``: the default group).

    Returns:
        The attached state and mirror update (checkpoint with ``state_dict()``).

    Raises:
        TypeError: If ``ddp_model`` is not a ``DistributedDataParallel`` or ``optimizer`` not a
            ``torch.optim.Optimizer``, or ``density`` not a number.
        ValueError: If ``density`` is outside (0, 1], the model has no parameter needing a
            gradient, a parameter is missing from the optimizer, or the backend is not gloo or
            nccl.
        RuntimeError: torch.distributed is not initialised or ``process_group`` was destroyed:
            the message names the missing step.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise _checks.type_error(
            "ddp_model",
            ddp_model,
            "a torch.nn.parallel.DistributedDataParallel",
            "wrap the model: DistributedDataParallel(model)",
        )
    check_density(density)
    check_process_group(process_group)  # before anything is registered on the model
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise _checks.type_error(
            "optimizer",
            optimizer,
            "a torch.optim.Optimizer",
            "pass an optimizer over the model's parameters",
        )
    params = [p for p in ddp_model.module.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            "The ddp_model argument has no parameter with requires_grad=True, so there is no "
            "gradient to communicate; pass a model with trainable parameters."
        )
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [
        name
        for name, p in ddp_model.module.named_parameters()
        if p.requires_grad and id(p) not in in_optimizer
    ]
    if missing:
        raise ValueError(
            f"The optimizer argument does not hold the parameters {missing[:5]} of ddp_model; "
            "LaySA applies their sparse updates through it: build it from "
            "ddp_model.parameters()."
        )
    state = LaySAState(process_group, density, warmup_steps)
    state.params = params
    register_comm_hook(ddp_model, state, laysa_hook, "LaySA")
    mirror = MirrorWeightUpdate(state, optimizer, params)
    return LaySA(state, mirror)
