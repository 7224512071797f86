"""NodeGroups: profile a model, cut it into contiguous groups, gate each group's memory.

``pipeline(model)`` installs the gates, ``node_groups(model)`` lists the groups,
``partition(sizes, k)`` is the exact contiguous cut (Waterwave, IEEE TC 2023, Sec. 4).
"""

from __future__ import annotations

from waterwave_hpo.nodegroup._group import NodeGroup
from waterwave_hpo.nodegroup._partition import Partition
from waterwave_hpo.nodegroup._partition import partition
from waterwave_hpo.nodegroup._pipeline import node_groups
from waterwave_hpo.nodegroup._pipeline import pipeline
from waterwave_hpo.nodegroup._pipeline import trial_profile

__all__ = ["NodeGroup", "Partition", "node_groups", "partition", "pipeline", "trial_profile"]
