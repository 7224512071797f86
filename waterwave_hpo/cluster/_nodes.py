"""The alive nodes of a Ray cluster, as the elastic hosts see them.

The alive nodes of a Ray cluster, as the elastic hosts (RayExecutor's and ``tune_hosts()``'s)
see them, and how messages name nodes and Ray's errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NodeView:
    """An alive Ray node, as ``ray.nodes()`` describes it."""

    node_id: str
    address: str
    resources: Mapping[str, float]

    @property
    def label(self) -> str:
        """``"node 60df83ad (10.0.0.2)"``: how messages name it."""
        return f"node {self.node_id[:8]} ({self.address})"


def alive_nodes(ray: Any) -> list[NodeView]:
    """The cluster's alive nodes, in a stable order (by node id)."""
    nodes = [
        NodeView(
            node_id=str(node["NodeID"]),
            address=str(node.get("NodeManagerAddress", "?")),
            resources=dict(node.get("Resources", {})),
        )
        for node in ray.nodes()
        if node.get("Alive", False)
    ]
    return sorted(nodes, key=lambda node: node.node_id)


def interleave(groups: list[list[NodeView]]) -> list[NodeView]:
    """One from each group in turn: hosts spread over nodes first (as Ray's SPREAD)."""
    result: list[NodeView] = []
    for index in range(max((len(group) for group in groups), default=0)):
        result.extend(group[index] for group in groups if index < len(group))
    return result


def describe_error(error: BaseException) -> str:
    """The exception's type, first line and Ray's "because ..." line.

    The exception's type, first line and Ray's "because ..." line (e.g. "The actor died
    because its node has died. Node Id: ...").
    """
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    kept = lines[:1] + [line for line in lines[1:] if "because" in line][:1]
    return f"{type(error).__name__}: {' '.join(kept)}"
