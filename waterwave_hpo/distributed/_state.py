"""The state of the LaySA communication hook: settings, step count, buffers, residuals."""

from __future__ import annotations

from dataclasses import dataclass
import logging
from typing import Any
from typing import cast
import warnings

import torch
import torch.distributed as dist

from waterwave_hpo import _checks
from waterwave_hpo.distributed._buffers import BucketBuffers
from waterwave_hpo.distributed._buffers import LayerCentricBuffers
from waterwave_hpo.distributed._ledger import CommMemoryLedger

_logger = logging.getLogger(__name__)

SUPPORTED_BACKENDS = ("gloo", "nccl")

_nccl_warned = False


def _warn_nccl_untested_once() -> None:
    """Say, once per process, that the NCCL (GPU) path is written but has never been run."""
    global _nccl_warned
    if not _nccl_warned:
        _nccl_warned = True
        warnings.warn(
            "LaySA on NCCL is written against PyTorch's CUDA APIs but has not been run on a GPU "
            "yet (it is tested with gloo on the CPU); compare a few steps with density=1.0 "
            "against plain DDP before relying on it.",
            UserWarning,
            stacklevel=3,
        )


def check_density(density: object) -> float:
    """Validate ``density`` (fraction of each layer's gradient entries sent per step).

    Raises:
        TypeError: If it is not a real number.
        ValueError: If it is outside (0, 1].
    """
    if isinstance(density, bool) or not isinstance(density, (int, float)):
        raise _checks.type_error("density", density, "a float in (0, 1]", "pass e.g. density=0.01")
    if not 0.0 < float(density) <= 1.0:
        raise _checks.value_error(
            "density",
            density,
            "must be in (0, 1] (the fraction of each layer's gradient entries sent per step)",
            "pass e.g. density=0.01, or 1.0 for dense",
        )
    return float(density)


_INIT_FIX = (
    "call torch.distributed.init_process_group('gloo') (CPU) or ('nccl') (GPUs) first, then "
    "build the DistributedDataParallel model and attach the hook"
)


def check_process_group(process_group: object) -> dist.ProcessGroup:
    """The group a hook communicates over: ``process_group``, or the default group for ``None``.

    Checked when the hook is attached, so a missing step is named here rather than surfacing
    as torch's message (or a bare ``assert``) at the first backward pass.

    Args:
        process_group: A ``torch.distributed.ProcessGroup``, or ``None`` for the default group.

    Returns:
        The group.

    Raises:
        TypeError: ``process_group`` is not a ``ProcessGroup`` (e.g. a backend name such as
            ``"gloo"``).
        RuntimeError: torch.distributed is not available, not initialised, or the group was
            destroyed (``destroy_process_group``).
    """
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise _checks.type_error(
            "process_group",
            process_group,
            "a torch.distributed.ProcessGroup or None (the default group)",
            "pass None after torch.distributed.init_process_group("
            f"{process_group!r}), or a group from torch.distributed.new_group(...)"
            if isinstance(process_group, str)
            else "pass None (the default group) or a group from torch.distributed.new_group(...)",
        )
    if not dist.is_available():
        raise RuntimeError(
            _checks.message(
                "process_group",
                process_group,
                "torch.distributed is not available in this build of torch",
                "install a torch build with distributed support",
            )
        )
    if not dist.is_initialized():
        raise RuntimeError(
            _checks.message(
                "process_group",
                process_group,
                "torch.distributed has no default process group (init_process_group was not "
                "called, or destroy_process_group ended it)",
                _INIT_FIX,
            )
        )
    group = process_group if process_group is not None else dist.group.WORLD
    try:
        dist.get_backend(group)
    except (RuntimeError, ValueError):
        raise RuntimeError(
            _checks.message(
                "process_group",
                process_group,
                "is not a live group of this process (it was destroyed by "
                "destroy_process_group, or made before the current init_process_group)",
                "create the group again with torch.distributed.new_group(...), or pass None "
                "for the default group",
            )
        ) from None
    return cast(dist.ProcessGroup, group)  # is_initialized() above: WORLD is not None


def check_backend(process_group: dist.ProcessGroup) -> str:
    """The group's backend, if the hook supports it.

    Raises:
        ValueError: If the backend is not gloo or nccl.
    """
    backend = str(dist.get_backend(process_group))
    if backend not in SUPPORTED_BACKENDS:
        raise ValueError(
            f"The process group's backend is {backend!r} but LaySA supports "
            f"{' and '.join(SUPPORTED_BACKENDS)}; create the group with "
            "dist.init_process_group('gloo') on the CPU or 'nccl' on GPUs."
        )
    return backend


@dataclass
class SentBucket:
    """A bucket whose sparse message was exchanged this step, awaiting the mirror update."""

    buffers: BucketBuffers
    world_size: int


class LaySAState:
    """State of :func:`laysa_hook`, in the manner of PyTorch's ``PowerSGDState``.

    Holds the settings, the step count, the layer-centric buffers and, between steps, where
    each layer's error-feedback residual lives (a view of DDP's gradient bucket). Pickles
    (``torch.save``) with the residuals' values and without the process group, which is set to
    the default group on load, as ``PowerSGDState`` does.

    Args:
        process_group: The data-parallel group (``None``: the default group).
        density: Fraction of each layer's gradient entries sent per step, in (0, 1]. At 1 every
            step is DDP's dense average, exactly.
        warmup_steps: Dense steps before sparsification starts (at least 1: DDP rebuilds its
            buckets after the first iteration).

    Raises:
        TypeError: If ``density`` or ``warmup_steps`` has the wrong type.
        ValueError: If ``density`` is outside (0, 1], ``warmup_steps`` < 1, or the backend is
            neither gloo nor nccl.
        RuntimeError: torch.distributed is not initialised or ``process_group`` was destroyed
            (see :func:`check_process_group`).
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        density: float,
        warmup_steps: int = 1,
    ) -> None:
        self.density = check_density(density)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int):
            raise _checks.type_error(
                "warmup_steps", warmup_steps, "an int >= 1", "pass e.g. warmup_steps=1"
            )
        if warmup_steps < 1:
            raise _checks.value_error(
                "warmup_steps",
                warmup_steps,
                "must be >= 1 (DDP rebuilds its buckets after the first step, so that step is "
                "dense)",
                "pass warmup_steps=1",
            )
        group = check_process_group(process_group)
        if check_backend(group) == "nccl":
            _warn_nccl_untested_once()
        self.process_group: dist.ProcessGroup = group
        self.warmup_steps = warmup_steps
        self.iteration = 0
        self.ledger = CommMemoryLedger()
        self.buffers = LayerCentricBuffers(self.ledger)
        self.bytes_sent_last_step = 0
        self.bytes_sent_total = 0
        self._bytes_this_step = 0
        self.sent: list[SentBucket] = []
        # id(param) -> (param, view of DDP's bucket holding its residual)
        self.residual_views: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        # id(param) -> residual restored from a checkpoint, added on the next backward
        self.pending_residuals: dict[int, torch.Tensor] = {}
        self.params: list[torch.nn.Parameter] = []
        self.warned_single_process = False

    def is_dense_step(self) -> bool:
        """Whether this step all-reduces densely (warm-up, or density 1)."""
        return self.density >= 1.0 or self.iteration < self.warmup_steps

    def end_step(self) -> None:
        """Called by the hook after the last bucket of a step."""
        self.iteration += 1
        self.bytes_sent_last_step = self._bytes_this_step
        self.bytes_sent_total += self._bytes_this_step
        self._bytes_this_step = 0

    def count_sent(self, nbytes: int) -> None:
        """Count ``nbytes`` this rank contributed to a collective this step."""
        self._bytes_this_step += nbytes

    def residual(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The error-feedback residual of ``param`` now (zeros if none), shape of ``param``.

        The residual is what this rank computed but has not sent yet; it is added to the
        parameter's next gradient.
        """
        pending = self.pending_residuals.get(id(param))
        if pending is not None:
            return pending.clone()
        found = self.residual_views.get(id(param))
        if found is None:
            return torch.zeros_like(param)
        return found[1].detach().clone()

    def state_dict(self) -> dict[str, Any]:
        """Settings, step count and every residual (a tensor per parameter, or ``None``).

        Plain tensors and numbers: ``torch.save`` it with the model and optimizer and load it
        with ``torch.load(..., weights_only=True)``.
        """
        residuals = [
            self.residual(p)
            if (id(p) in self.residual_views or id(p) in self.pending_residuals)
            else None
            for p in self.params
        ]
        return {
            "density": self.density,
            "warmup_steps": self.warmup_steps,
            "iteration": self.iteration,
            "bytes_sent_total": self.bytes_sent_total,
            "residuals": residuals,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the step count and residuals saved by :meth:`state_dict`.

        The residuals are added to the next gradients. The density and warm-up of this state
        are kept (they are the caller's settings).

        Raises:
            ValueError: If the checkpoint holds a different number of parameters.
        """
        residuals: list[torch.Tensor | None] = state_dict["residuals"]
        if len(residuals) != len(self.params):
            raise ValueError(
                f"The saved LaySA state has {len(residuals)} parameters but this model has "
                f"{len(self.params)}; load a checkpoint of the same model."
            )
        self.iteration = int(state_dict["iteration"])
        self.bytes_sent_total = int(state_dict["bytes_sent_total"])
        self.residual_views.clear()
        self.pending_residuals = {
            id(p): r.to(p.device)
            for p, r in zip(self.params, residuals, strict=True)
            if r is not None
        }

    def __getstate__(self) -> dict[str, Any]:
        _logger.warning(
            "The process group is not serializable and is excluded from a saved LaySAState; "
            "the default group is used on load."
        )
        return self.state_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(None, state["density"], state["warmup_steps"])  # type: ignore[misc]
        self.iteration = state["iteration"]
        self.bytes_sent_total = state["bytes_sent_total"]
        self.restored_state_dict: dict[str, Any] | None = state


def register_comm_hook(ddp_model: object, state: object, hook: Any, what: str) -> None:
    """``ddp_model.register_comm_hook(state, hook)``, with DDP's refusals naming ``ddp_model``.

    Args:
        ddp_model: The model the caller was given.
        state: The hook's state.
        hook: The communication hook.
        what: The hook's name for the message, e.g. ``"LaySA"``.

    Raises:
        TypeError: ``ddp_model`` is not a ``DistributedDataParallel``.
        ValueError: DDP refused the hook (it allows one per model); DDP's error is the cause.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise _checks.type_error(
            "ddp_model",
            ddp_model,
            "a torch.nn.parallel.DistributedDataParallel",
            "wrap the model: DistributedDataParallel(model)",
        )
    try:
        ddp_model.register_comm_hook(state, hook)
    except RuntimeError as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise _checks.value_error(
            "ddp_model",
            f"<DistributedDataParallel of {type(ddp_model.module).__name__}>",
            f"refused the {what} communication hook ({first})",
            "DDP takes one communication hook per model for its whole life: wrap the model "
            "in a new DistributedDataParallel(model) for each hook",
        ) from error
