"""How the elastic hosts read the cluster's nodes and name them and Ray's errors (no Ray
needed: ``ray.nodes()`` is a list of dicts)."""

from __future__ import annotations

from typing import Any

from waterwave_hpo.cluster._nodes import NodeView
from waterwave_hpo.cluster._nodes import alive_nodes
from waterwave_hpo.cluster._nodes import describe_error
from waterwave_hpo.cluster._nodes import interleave


class _Ray:
    def __init__(self, nodes: list[dict[str, Any]]) -> None:
        self._nodes = nodes

    def nodes(self) -> list[dict[str, Any]]:
        return self._nodes


def test_alive_nodes_leaves_out_dead_nodes_and_keeps_a_stable_order() -> None:
    ray = _Ray(
        [
            {"NodeID": "bb", "Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {}},
            {"NodeID": "cc", "Alive": False, "NodeManagerAddress": "10.0.0.3", "Resources": {}},
            {
                "NodeID": "aa",
                "Alive": True,
                "NodeManagerAddress": "10.0.0.1",
                "Resources": {"GPU": 2.0},
            },
        ]
    )
    nodes = alive_nodes(ray)
    assert [node.node_id for node in nodes] == ["aa", "bb"]
    assert nodes[0].resources == {"GPU": 2.0}
    assert nodes[0].label == "node aa (10.0.0.1)"


def test_interleave_spreads_hosts_over_nodes_first() -> None:
    a = NodeView("a", "10.0.0.1", {"GPU": 3.0})
    b = NodeView("b", "10.0.0.2", {"GPU": 1.0})
    assert [n.node_id for n in interleave([[a, a, a], [b]])] == ["a", "b", "a", "a"]
    assert interleave([]) == []


def test_describe_error_keeps_the_first_line_and_rays_reason() -> None:
    error = RuntimeError(
        "The actor died unexpectedly before finishing this task.\n\tclass_name: HostActor\n"
        "The actor died because its node has died. Node Id: 60df83ad\n\tmore"
    )
    assert describe_error(error) == (
        "RuntimeError: The actor died unexpectedly before finishing this task. "
        "The actor died because its node has died. Node Id: 60df83ad"
    )
    assert describe_error(ValueError()) == "ValueError: "
