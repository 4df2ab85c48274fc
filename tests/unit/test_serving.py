"""The push's pause and sleep state machine, and the start order of replicas sharing a GPU."""

from __future__ import annotations

import asyncio

import pytest

from torchrl_vllm_ext.engine.driver import cluster
from torchrl_vllm_ext.engine.driver.pool import ReplicaPool
from torchrl_vllm_ext.engine.serving import ServingState, restart_steps, update_steps
from torchrl_vllm_ext.errors import ConfigurationError, WeightSyncError

AWAKE = ServingState()
PAUSED = AWAKE.paused_as("keep", False)
LEVEL1 = AWAKE.slept(1)
LEVEL2_WEIGHTS_AWAKE = AWAKE.slept(2).woke(["weights"])


@pytest.mark.parametrize(
    ("state", "pause", "probe_now"),
    [
        (AWAKE, True, True),  # the push pauses, loads, resumes, probes
        (PAUSED, False, False),  # paused by the user: stays paused, probe at resume()
        (LEVEL2_WEIGHTS_AWAKE, False, False),  # KV cache unmapped: no forward pass yet
        (LEVEL2_WEIGHTS_AWAKE.paused_as("abort", True), False, False),
    ],
)
def test_a_push_pauses_and_resumes_only_a_serving_replica(state, pause, probe_now):
    steps = update_steps(state, 3, "v1")
    assert (steps.pause, steps.probe_now) == (pause, probe_now)


@pytest.mark.parametrize(
    ("state", "match"),
    [
        (LEVEL1, r"replica 3 sleeps \(level 1\) with its weights offloaded to host memory"),
        (AWAKE.slept(2), r"level 2\) with its weights released"),
        (AWAKE.slept(2).woke(["kv_cache"]), "wake_up\\(\\['weights'\\]\\) before pushing"),
    ],
)
def test_a_push_into_sleeping_weights_is_refused_naming_the_replica_and_the_fix(state, match):
    with pytest.raises(WeightSyncError, match=match):
        update_steps(state, 3, "v1")


def test_waking_in_parts_serves_only_once_everything_is_awake():
    s = AWAKE.slept(2)
    assert s.asleep == {"weights", "kv_cache"} and not s.serving
    s = s.woke(["weights"])
    assert s.weights_awake and not s.serving and s.sleep_level == 2
    s = s.woke(["kv_cache"])
    assert s.serving and s.sleep_level == 0
    assert AWAKE.slept(1).woke(None).serving
    paused = PAUSED.slept(1).woke(None)
    assert not paused.serving and paused.paused == ("keep", False), "a wake-up keeps the pause"
    assert paused.resumed().serving


@pytest.mark.parametrize("tags", ["weights", ["weights", "cache"], ["scheduling"]])
def test_bad_wake_tags_are_refused_naming_vllms_tags(tags):
    with pytest.raises(ConfigurationError, match="'weights', 'kv_cache'"):
        AWAKE.slept(1).woke(tags)


def test_bad_sleep_level_is_refused():
    with pytest.raises(ConfigurationError, match="level must be 1 or 2"):
        AWAKE.slept(3)


@pytest.mark.parametrize(
    ("state", "steps"),
    [
        (AWAKE, ["bring_up"]),
        (PAUSED, ["bring_up", "pause"]),
        (LEVEL1, ["bring_up", "sleep"]),  # level 1 then keeps the live weights in host memory
        (AWAKE.slept(2), ["bring_up", "sleep"]),
        # weights woken to be pushed into: sleep, wake them, then load the live version
        (LEVEL2_WEIGHTS_AWAKE, ["sleep", "wake_weights", "bring_up"]),
        (
            LEVEL2_WEIGHTS_AWAKE.paused_as("abort", True),
            ["sleep", "wake_weights", "bring_up", "pause"],
        ),
    ],
)
def test_a_restarted_replica_comes_back_in_the_services_state(state, steps):
    assert restart_steps(state) == steps


# ---------------------------------------------------------------------- start order
class _Actor:
    """Stands in for a replica actor's ``visible_devices`` (a Ray method's ``.remote``)."""

    def __init__(self, node: str, devices: str):
        self.visible_devices = self
        self._answer = (node, devices)

    def remote(self):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(self._answer)
        return fut


def _pool(gpus: float) -> ReplicaPool:
    from torchrl_vllm_ext.engine.config import ServiceConfig
    from torchrl_vllm_ext.testing import make_tiny_model

    pool = ReplicaPool(ServiceConfig(model=make_tiny_model()), "svc")
    pool._res = cluster.ReplicaResources(use_gpu=True, num_workers=1, cpus=1.0, gpus=gpus)
    return pool


async def _starts(pool: ReplicaPool, actors) -> list[tuple[str, int]]:
    """Enter each actor's start lock at once, hold it briefly; the order of events."""
    events: list[tuple[str, int]] = []

    async def start(i, actor):
        async with pool._start_lock(actor, f"r{i}"):
            events.append(("in", i))
            await asyncio.sleep(0.02)
            events.append(("out", i))

    await asyncio.gather(*(start(i, a) for i, a in enumerate(actors)))
    return events


def _overlapping(events) -> bool:
    inside = 0
    for kind, _ in events:
        inside += 1 if kind == "in" else -1
        if inside > 1:
            return True
    return False


def test_replicas_sharing_a_gpu_start_one_after_another():
    events = asyncio.run(_starts(_pool(0.5), [_Actor("n1", "0"), _Actor("n1", "0")]))
    assert not _overlapping(events)


def test_replicas_on_different_gpus_or_nodes_start_together():
    actors = [_Actor("n1", "0"), _Actor("n1", "1"), _Actor("n2", "0")]
    assert _overlapping(asyncio.run(_starts(_pool(0.5), actors)))


def test_replicas_with_whole_gpus_never_wait_for_a_start_lock():
    assert _overlapping(asyncio.run(_starts(_pool(1.0), [_Actor("n1", "0"), _Actor("n1", "0")])))


def test_start_lock_key_normalises_device_lists():
    assert cluster.start_lock_key(("n", "1, 0")) == cluster.start_lock_key(("n", "0,1"))
    assert cluster.start_lock_key(("n", "")) == ("n", "*")
