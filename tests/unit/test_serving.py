"""The push's pause and sleep state machine, and the start order of replicas sharing a GPU."""

from __future__ import annotations

import asyncio

import pytest

from torchrl_vllm_ext.engine.driver import cluster
from torchrl_vllm_ext.engine.driver.launcher import ReplicaLauncher
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
# The launcher's glue of engine/driver/start_order.py (its logic: tests/unit/test_start_order.py),
# over stand-ins of a replica actor's Ray methods.
class _Method:
    """A Ray actor method's ``.remote(...)`` / ``.options(...).remote(...)``."""

    def __init__(self, fn):
        self._fn = fn

    def options(self, **_):
        return self

    def remote(self, *args):
        return asyncio.ensure_future(self._fn(*args))


class _Actor:
    """A replica actor on GPU ``devices`` of ``node``: its engine logs a KV size of
    ``size`` 20 ms into a 60 ms start."""

    def __init__(self, events, name, node="n1", devices="0", size=6 << 30):
        self.events, self.name, self.size, self.logged = events, name, size, None

        async def where():
            return node, devices

        self.visible_devices = _Method(where)
        self.start = _Method(self._start)
        self.kv_cache_size = _Method(self._kv_cache_size)
        self.preload = _Method(self._preload)
        self.over = asyncio.Event()

    async def _start(self, kv_bytes=None, report=False):
        self.events.append(("in", self.name, kv_bytes))
        await asyncio.sleep(0.02)
        self.logged = self.size if report else None
        await asyncio.sleep(0.04)
        self.events.append(("out", self.name, kv_bytes))
        self.over.set()
        return self.name

    async def _kv_cache_size(self):
        while self.logged is None and not self.over.is_set():
            await asyncio.sleep(0.005)
        return self.logged

    async def _preload(self):
        self.events.append(("preload", self.name, None))


def _launcher(gpus: float, **engine) -> ReplicaLauncher:
    from torchrl_vllm_ext.engine.config import ServiceConfig
    from torchrl_vllm_ext.engine.driver.start_order import orders_starts
    from torchrl_vllm_ext.testing import make_tiny_model

    launcher = ReplicaLauncher(ServiceConfig(model=make_tiny_model(), engine_kwargs=engine))
    launcher._res = cluster.ReplicaResources(use_gpu=True, num_workers=1, cpus=1.0, gpus=gpus)
    launcher._orders_starts = orders_starts(
        cluster.shares_gpus(launcher._res), cluster.engine_kwargs(launcher._res, launcher.config)
    )
    return launcher


def _starts(launcher: ReplicaLauncher, *specs) -> list[tuple]:
    """Start each stand-in at once through the launcher; the order of events."""

    async def main():
        events: list[tuple] = []
        actors = [_Actor(events, i, **spec) for i, spec in enumerate(specs)]
        done = await asyncio.gather(*(launcher.start_engine(a, a.name) for a in actors))
        assert done == list(range(len(specs)))
        return events

    return asyncio.run(main())


def _overlapping(events) -> bool:
    inside = 0
    for kind, *_ in events:
        inside += {"in": 1, "out": -1}.get(kind, 0)
        if inside > 1:
            return True
    return False


def test_replicas_sharing_a_gpu_start_pinned_once_the_first_logged_its_size():
    launcher = _launcher(0.5)
    events = _starts(launcher, {}, {})
    assert events[0] == ("in", 0, None), "the first starts alone, sized by vLLM"
    assert ("preload", 1, None) in events, "the other imports vLLM meanwhile"
    second = events.index(("in", 1, 6 << 30))
    assert second < events.index(("out", 0, None)), "it starts before the first serves"
    pin = launcher.start_gates.order.pins[("n1", "0")]
    assert (pin.nbytes, pin.measured_by) == (6 << 30, 0)
    assert "kv_cache_memory_bytes" not in launcher.config.engine_kwargs
    assert _starts(launcher, {})[0] == ("in", 0, 6 << 30), "a restart reuses the size at once"


def test_replicas_on_different_gpus_or_nodes_profile_together():
    events = _starts(_launcher(0.5), {"devices": "0"}, {"devices": "1"}, {"node": "n2"})
    assert _overlapping(events)
    assert all(kv is None for kind, _, kv in events if kind == "in")


@pytest.mark.parametrize(("gpus", "engine"), [(1.0, {}), (0.5, {"kv_cache_memory_bytes": 4 << 30})])
def test_whole_gpus_or_a_given_size_start_at_once(gpus, engine):
    events = _starts(_launcher(gpus, **engine), {}, {})
    assert _overlapping(events)
    assert not any(kind == "preload" for kind, *_ in events)


def test_without_a_logged_size_the_replicas_profile_one_after_another():
    events = _starts(_launcher(0.5), {"size": None}, {"size": None})
    assert not _overlapping(events)
    assert [kv for kind, _, kv in events if kind == "in"] == [None, None]


def test_start_lock_key_normalises_device_lists():
    assert cluster.start_lock_key(("n", "1, 0")) == cluster.start_lock_key(("n", "0,1"))
    assert cluster.start_lock_key(("n", "")) == ("n", "*")
