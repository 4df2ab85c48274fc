"""Which node each replica goes to (engine/driver/placement.py, cluster.ReplicaResources)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from torchrl_vllm_ext.engine.driver.cluster import ReplicaResources
from torchrl_vllm_ext.engine.placement import Node, plan
from torchrl_vllm_ext.errors import InsufficientResourcesError

NEED = {"CPU": 0.5, "rollout": 0.01}


def nodes():
    """A head without the replicas' resource, and two replica nodes of 2 CPUs."""
    return [
        Node("127.0.0.1", {"CPU": 4.0}),
        Node("127.0.0.2", {"CPU": 2.0, "rollout": 1.0}),
        Node("127.0.0.3", {"CPU": 2.0, "rollout": 1.0}),
    ]


def test_spread_alternates_over_the_nodes_that_have_the_resource():
    assert plan("spread", 4, NEED, nodes(), Counter()) == ["127.0.0.2", "127.0.0.3"] * 2


def test_spread_starts_with_the_node_that_has_fewest_of_ours():
    ours = Counter({"127.0.0.2": 2})
    assert plan("spread", 2, NEED, nodes(), ours) == ["127.0.0.3", "127.0.0.3"]
    assert ours == Counter({"127.0.0.2": 2, "127.0.0.3": 2})


def test_pack_fills_one_node_then_the_next():
    assert plan("pack", 5, NEED, nodes(), Counter()) == ["127.0.0.2"] * 4 + ["127.0.0.3"]


def test_pack_joins_the_node_already_holding_replicas():
    assert plan("pack", 1, NEED, nodes(), Counter({"127.0.0.3": 1})) == ["127.0.0.3"]


def test_strict_spread_refuses_a_second_replica_on_a_node():
    assert plan("strict_spread", 2, NEED, nodes(), Counter()) == ["127.0.0.2", "127.0.0.3"]
    with pytest.raises(InsufficientResourcesError, match=r"strict_spread.*spread"):
        plan("strict_spread", 3, NEED, nodes(), Counter())


def test_full_nodes_are_refused_with_what_each_has_free():
    with pytest.raises(InsufficientResourcesError, match=r"127\.0\.0\.2.*CPU"):
        plan("spread", 9, NEED, nodes(), Counter())


def test_any_leaves_the_choice_to_ray():
    assert plan("any", 2, NEED, [], Counter()) == [None, None]


def test_a_pinned_replica_asks_for_its_nodes_own_resource_in_every_bundle():
    cpu = ReplicaResources(use_gpu=False, num_workers=1, cpus=0.5, extra={"rollout": 0.01})
    assert cpu.bundles("127.0.0.2") == [{"CPU": 0.5, "rollout": 0.01, "node:127.0.0.2": 0.001}]
    assert cpu.bundles() == [{"CPU": 0.5, "rollout": 0.01}]
    gpu = ReplicaResources(use_gpu=True, num_workers=2, cpus=1.0)
    assert all("node:10.0.0.5" in b for b in gpu.bundles("10.0.0.5"))
    assert gpu.need() == {"GPU": 2.0, "CPU": 2.0}


def test_a_node_to_avoid_is_taken_only_when_no_other_fits():
    ours = Counter({"127.0.0.2": 1})
    avoid = frozenset({"127.0.0.3"})
    assert plan("spread", 1, NEED, nodes(), ours, avoid) == ["127.0.0.2"]
    full = [Node("127.0.0.2", {"CPU": 0.1, "rollout": 1.0}), *nodes()[2:]]
    assert plan("spread", 1, NEED, full, Counter(), avoid) == ["127.0.0.3"]


def test_replicas_sharing_a_gpu_split_its_memory():
    from torchrl_vllm_ext.engine.driver.cluster import actor_options, engine_kwargs

    half = ReplicaResources(use_gpu=True, num_workers=1, cpus=1.0, gpus=0.5)
    assert half.bundles() == [{"GPU": 0.5, "CPU": 1.0}]

    def config(**engine):  # the fields engine_kwargs reads
        return SimpleNamespace(
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            worker_extension_cls=None,
            engine_kwargs=engine,
        )

    assert engine_kwargs(half, config())["gpu_memory_utilization"] == 0.45
    assert engine_kwargs(half, config(gpu_memory_utilization=0.3))["gpu_memory_utilization"] == 0.3
    assert actor_options(half, "r", pg=None)["num_gpus"] == 0.5
