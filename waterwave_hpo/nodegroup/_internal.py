"""What the NodeGroup package offers the project's other packages beyond its public facade.

The HOME planner (``waterwave_hpo.planning``) profiles a model's NodeGroups and sizes tensors the
way the gates do. It imports these from here only (issue 16, item 3). Not part of the public API.
"""

from __future__ import annotations

import torch.nn as nn

from waterwave_hpo.nodegroup._pipeline import _PIPELINES
from waterwave_hpo.nodegroup._pipeline import _profile_on as profile_on
from waterwave_hpo.nodegroup._profile import Profiler
from waterwave_hpo.nodegroup._profile import iter_tensors
from waterwave_hpo.nodegroup._profile import tensor_bytes

__all__ = ["Profiler", "has_pipeline", "iter_tensors", "profile_on", "tensor_bytes"]


def has_pipeline(model: nn.Module) -> bool:
    """Whether :func:`waterwave_hpo.pipeline` has installed its gates on ``model``."""
    return model in _PIPELINES
