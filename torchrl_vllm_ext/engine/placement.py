"""Which Ray node each replica goes to: ``any``, ``pack``, ``spread`` or ``strict_spread``.

A replica's placement group is pinned to the chosen node through Ray's per-node
resource ``node:<ip>`` (every node has 1.0 of it; a bundle asks for a sliver), the way
vLLM places its data-parallel ranks. The choice is made here, in the driver, from the
live nodes' free resources, for all replicas of a launch at once: Ray's own group
strategies apply within one group, and each replica has its own group so that it can
be restarted and removed alone.

* ``any``: no pin; Ray places each group where it fits (one host or many).
* ``pack``: fill the node that holds most of this service's replicas first.
* ``spread``: the node with fewest of this service's replicas first.
* ``strict_spread``: at most one replica per node; refused when nodes run out.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torchrl_vllm_ext.errors import InsufficientResourcesError

PLACEMENTS = ("any", "pack", "spread", "strict_spread")
NODE_PIN = 0.001
"""Amount of a node's ``node:<ip>`` resource a pinned bundle asks for."""


def node_resource(ip: str) -> str:
    """Ray's built-in resource that only the node at ``ip`` has."""
    return f"node:{ip}"


@dataclass
class Node:
    """A live Ray node as the planner sees it."""

    ip: str
    free: dict[str, float]
    """Resources not yet reserved."""

    def fits(self, need: dict[str, float]) -> bool:
        return all(self.free.get(key, 0.0) >= amount - 1e-9 for key, amount in need.items())

    def take(self, need: dict[str, float]) -> None:
        for key, amount in need.items():
            self.free[key] = self.free.get(key, 0.0) - amount


def plan(
    strategy: str,
    count: int,
    need: dict[str, float],
    nodes: list[Node],
    ours: Counter,
    avoid: frozenset[str] = frozenset(),
) -> list[str | None]:
    """The node (IP) for each of ``count`` new replicas; None where Ray chooses.

    ``need``: what one replica reserves on its node (all its bundles summed);
    ``nodes``: the live nodes with their free resources (updated in place);
    ``ours``: this service's replicas per node IP so far (updated in place);
    ``avoid``: nodes taken only when no other fits (where a replica just died: Ray
    may not have noticed yet that the node is gone).

    Examples:
        >>> nodes = [Node("10.0.0.1", {"CPU": 4.0}), Node("10.0.0.2", {"CPU": 4.0})]
        >>> plan("spread", 3, {"CPU": 1.0}, nodes, Counter())
        ['10.0.0.1', '10.0.0.2', '10.0.0.1']
        >>> plan("pack", 2, {"CPU": 1.0}, nodes, Counter({"10.0.0.2": 1}))
        ['10.0.0.2', '10.0.0.2']
    """
    if strategy == "any":
        return [None] * count
    order = {node.ip: i for i, node in enumerate(nodes)}
    chosen: list[str | None] = []
    for _ in range(count):
        fitting = [n for n in nodes if n.fits(need)]
        if strategy == "strict_spread":
            fitting = [n for n in fitting if ours[n.ip] == 0]
        if not fitting:
            raise InsufficientResourcesError(_refusal(strategy, need, nodes, ours))
        if strategy == "pack":
            node = min(fitting, key=lambda n: (n.ip in avoid, -ours[n.ip], order[n.ip]))
        else:  # spread, strict_spread
            node = min(
                fitting,
                key=lambda n: (n.ip in avoid, ours[n.ip], -n.free.get("CPU", 0.0), order[n.ip]),
            )
        node.take(need)
        ours[node.ip] += 1
        chosen.append(node.ip)
    return chosen


def _refusal(strategy: str, need: dict[str, float], nodes: list[Node], ours: Counter) -> str:
    free = {n.ip: {k: round(n.free.get(k, 0.0), 3) for k in need} for n in nodes}
    if strategy == "strict_spread":
        return (
            f"placement='strict_spread' puts at most one replica per node, and every node that "
            f"could hold one ({dict(ours)} replicas per node; free {free}) already has one or "
            f"lacks {need}. Add nodes, or use placement='spread'."
        )
    return (
        f"no live node can hold another replica needing {need} (free per node: {free}); "
        "add nodes, lower cpus_per_replica, or launch fewer replicas."
    )


__all__ = ["NODE_PIN", "PLACEMENTS", "Node", "node_resource", "plan"]
