"""A real three-node Ray cluster on loopback addresses (testing/loopback_cluster.py).

The head (the driver's node, 127.0.0.4) has no ``rollout`` resource; two worker nodes
(127.0.0.2, 127.0.0.3) have 2 CPUs and ``rollout`` each, so replicas that ask for
``rollout`` go to worker nodes only, and the driver (the trainer) is on another node
than every replica. It must be the process's first Ray session (a driver that had a
local Ray cannot start actors on another cluster), so tests/conftest.py runs this tier
first whatever order the files are given in.
"""

from __future__ import annotations

import os

import pytest
import ray

from torchrl_vllm_ext.testing.loopback_cluster import LoopbackCluster, NodeSpec

from ..helpers import LORA_KWARGS, WORKERS, launch_on_workers, replicas_without_torch_compile


@pytest.fixture(scope="package")
def loopback():
    if ray.is_initialized():
        pytest.fail(
            "this process still holds a Ray connection (a test that did not shut its service "
            "down?); the loopback cluster needs a process without one"
        )
    saved = {k: os.environ.get(k) for k in LoopbackCluster.env()}
    os.environ.update(LoopbackCluster.env())
    with replicas_without_torch_compile():
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
