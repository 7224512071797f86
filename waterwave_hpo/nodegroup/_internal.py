"""What the NodeGroup package offers the project's other packages beyond its public facade.

The HOME planner (``waterwave_hpo.planning``) profiles a model's NodeGroups and sizes tensors the
way the gates do. It imports these from here only. Not part of the public API.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from waterwave_hpo.nodegroup._gates import gates_muted
from waterwave_hpo.nodegroup._hooks import ModuleObserver
from waterwave_hpo.nodegroup._pipeline import _PIPELINES
from waterwave_hpo.nodegroup._pipeline import _profile_on as profile_on
from waterwave_hpo.nodegroup._profile import Profiler
from waterwave_hpo.nodegroup._profile import iter_tensors
from waterwave_hpo.nodegroup._profile import tensor_bytes

__all__ = [
    "ModuleObserver",
    "Profiler",
    "gated_claim_bytes",
    "gates_declared",
    "gates_muted",
    "has_pipeline",
    "iter_tensors",
    "profile_on",
    "remove_pipeline",
    "tensor_bytes",
]


def has_pipeline(model: nn.Module) -> bool:
    """Whether :func:`waterwave_hpo.pipeline` has installed its gates on ``model``."""
    return model in _PIPELINES


def gated_claim_bytes(model: nn.Module, example_input: Any) -> int | None:
    """What the gates of ``model`` reserve at a training step's peak, in bytes, or ``None``.

    Parameters and gradients plus every NodeGroup's saved bytes (all are held between the end
    of the forward and the start of the backward). A model not profiled yet is profiled on
    ``example_input`` now, gates muted (one step whose effects are undone, as
    ``pipeline(model, example_input=...)``). ``None`` for a model without gates.
    """
    pipe = _PIPELINES.get(model)
    if pipe is None:
        return None
    if pipe.build() is None:
        with gates_muted():
            profile_on(model, example_input)
    gates = pipe.build()
    return None if gates is None else gates.profile.peak_bytes


def gates_declared(model: nn.Module, scheduler: Any, trial_number: int) -> bool:
    """Whether the gates of ``model`` have declared its profile to ``scheduler`` for the trial.

    Once they have, they hold its parameters and gradients (``RESIDENT``) until the trial ends.
    """
    pipe = _PIPELINES.get(model)
    if pipe is None or pipe.gates is None:
        return False
    return bool(scheduler.declared(trial_number, key=id(pipe.gates)))


def remove_pipeline(model: nn.Module) -> None:
    """Remove the gates (and the profiler) :func:`waterwave_hpo.pipeline` installed on ``model``."""
    pipe = _PIPELINES.pop(model, None)
    if pipe is not None:
        pipe.remove()
