"""A real three-node Ray cluster on loopback addresses (testing/loopback_cluster.py).

The head (the driver's node, 127.0.0.4) has no ``rollout`` resource; two worker nodes
(127.0.0.2, 127.0.0.3) have 2 CPUs and ``rollout`` each, so replicas that ask for
``rollout`` go to worker nodes only, and the driver (the trainer) is on another node
than every replica. This tier runs first (tests/cluster sorts before the others): the
driver process can hold one Ray connection, and the other tiers start a local one.
"""

from __future__ import annotations

import os

import pytest
import ray

from torchrl_vllm_ext import VLLMService
from torchrl_vllm_ext.testing.loopback_cluster import LoopbackCluster, NodeSpec

from ..integration.conftest import ENGINE_KWARGS, hf_model  # noqa: F401 (a fixture)

WORKERS = ("127.0.0.2", "127.0.0.3")
ON_WORKERS = {"rollout": 0.01}
LORA_KWARGS = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}


@pytest.fixture(scope="package")
def loopback():
    if ray.is_initialized():
        pytest.skip("this process already holds a Ray connection; run tests/cluster first or alone")
    saved = {k: os.environ.get(k) for k in LoopbackCluster.env()}
    os.environ.update(LoopbackCluster.env())
    cluster = LoopbackCluster([NodeSpec(ip, 2, {"rollout": 2}) for ip in WORKERS]).start()
    try:
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        left = cluster.processes()
        assert not left, f"processes of the loopback cluster left behind: {left}"


def launch_on_workers(cluster, model, **kwargs) -> VLLMService:
    """A service on ``cluster`` whose replicas go to the worker nodes only."""
    return VLLMService.launch(
        model,
        ray_address=cluster.address,
        replica_resources=ON_WORKERS,
        **{"health_check_interval": 0, **kwargs},
        **ENGINE_KWARGS,
    )


@pytest.fixture(scope="package")
def spread_service(loopback, tiny_model):
    """Two replicas spread over the two worker nodes, LoRA on."""
    svc = launch_on_workers(
        loopback,
        tiny_model,
        num_replicas=2,
        placement="spread",
        cpus_per_replica=0.5,
        health_check_interval=1.0,
        **LORA_KWARGS,
    )
    yield svc
    svc.shutdown()


def nodes_of(service) -> dict[int, str]:
    return {rid: service.replica_info(rid).node_ip for rid in service.replica_ids}
