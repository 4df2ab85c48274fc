"""Shutdown releases every actor, placement group and engine process, also after a failed launch.

The GPU start order on CPU engines is checked in test_engine_modes.py, whose AsyncLLM
replicas start in it."""

from __future__ import annotations

import time

import psutil
import pytest
import ray

from torchrl_vllm_ext import ReplicaStartupError, ServiceClosedError, VLLMService
from torchrl_vllm_ext.testing import make_tiny_model

from ..helpers import CPUS_PER_REPLICA, ENGINE_KWARGS, child_pids, wait_until


def live_groups(prefix: str) -> list[str]:
    return [
        pg["name"]
        for pg in ray.util.placement_group_table().values()
        if pg["name"].startswith(prefix) and pg["state"] != "REMOVED"
    ]


def actor_exists(name: str) -> bool:
    try:
        ray.get_actor(name)
        return True
    except ValueError:
        return False


def test_context_manager_shutdown_releases_everything(tiny_model, ray_cluster):
    with VLLMService.launch(
        tiny_model, num_replicas=1, cpus_per_replica=CPUS_PER_REPLICA, **ENGINE_KWARGS
    ) as svc:
        rid = svc.replica_ids[0]
        pids = [svc.replica_info(rid).pid, *child_pids(svc, rid)]
        names = live_groups(svc.name)
        assert len(names) == 1
        assert len(svc.generate([[1, 2, 3]], {"max_tokens": 2})) == 1
    assert live_groups(svc.name) == []
    assert not actor_exists(names[0]), "the actor (named like its group) is gone"
    wait_until(
        lambda: (
            not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)
        ),
        30,
        what="replica and engine processes to exit",
    )
    with pytest.raises(ServiceClosedError, match="shut down"):
        svc.generate([[1, 2]], {"max_tokens": 2})
    svc.shutdown()  # idempotent


def test_failed_launch_releases_what_it_started_and_names_the_engine_cores_error(
    tiny_model, ray_cluster
):
    """An engine core that dies while it starts (as on GPU: its own process) with too
    little KV cache: vLLM says only "see root cause above"; the error names the cause."""
    before = set(live_groups("tvllm-"))
    with pytest.raises(ReplicaStartupError, match="could not start vLLM") as err:
        VLLMService.launch(
            tiny_model,
            num_replicas=1,
            cpus_per_replica=CPUS_PER_REPLICA,
            engine_process=True,
            **{**ENGINE_KWARGS, "max_model_len": 2048, "kv_cache_memory_bytes": 1 << 16},
        )
    assert "ValueError: No available memory for the cache blocks" in str(err.value)
    assert "in vLLM's engine-core process" in str(err.value)
    assert set(live_groups("tvllm-")) == before


def test_unservable_model_fails_fast_with_the_engines_own_cause(ray_cluster):
    """vLLM-CPU has no attention kernel for 24-wide heads: launch names the cause, at once."""
    model = make_tiny_model(hidden_size=96, head_dim=24)
    before = set(live_groups("tvllm-"))
    start = time.perf_counter()
    with pytest.raises(ReplicaStartupError, match="head_dim") as err:
        VLLMService.launch(
            model, num_replicas=2, cpus_per_replica=CPUS_PER_REPLICA, **ENGINE_KWARGS
        )
    elapsed = time.perf_counter() - start
    assert elapsed < 60, f"the typed error took {elapsed:.0f} s"
    assert "replica" in str(err.value) and str(model) in str(err.value)
    assert set(live_groups("tvllm-")) == before
