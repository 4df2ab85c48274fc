"""The start order of replicas sharing a GPU (engine/driver/start_order.py), on stand-ins:
the first profiles alone, the others start together with its KV-cache size pinned, a
restart reuses it, and without a size the GPU is profiled one replica at a time."""

from __future__ import annotations

import asyncio

import pytest

from torchrl_vllm_ext.engine.driver.start_order import (
    Pin,
    Role,
    StartGates,
    StartOrder,
    orders_starts,
)
from torchrl_vllm_ext.errors import ReplicaStartupError

GPU0 = ("10.0.0.2", "0")
GPU1 = ("10.0.0.2", "1")
GIB = 1 << 30


# ---------------------------------------------------------------------- the plain state
def test_the_first_replica_on_a_gpu_profiles_and_the_others_wait():
    order = StartOrder()
    assert order.turn(GPU0, 0).role is Role.PROFILE
    assert order.turn(GPU0, 0).role is Role.PROFILE  # asking again changes nothing
    assert order.turn(GPU0, 1).role is Role.WAIT
    assert order.turn(GPU0, 2).role is Role.WAIT
    assert order.turn(GPU1, 3).role is Role.PROFILE  # another GPU profiles at the same time
    assert order.profiling == {GPU0: 0, GPU1: 3}
    assert order.waiting == {GPU0: {1, 2}}


def test_the_measured_size_is_pinned_for_the_waiting_replicas_and_every_restart():
    order = StartOrder()
    order.turn(GPU0, 0), order.turn(GPU0, 1)
    pin = order.measured(GPU0, 0, 20 * GIB, after_s=40.04)
    assert pin == Pin(20 * GIB, measured_by=0, after_s=40.0)
    for replica in (1, 2, 0):  # the waiting one, a new one, the profiler restarted
        turn = order.turn(GPU0, replica)
        assert (turn.role, turn.kv_cache_memory_bytes) == (Role.PINNED, 20 * GIB)
    assert order.waiting == {} and order.profiling == {}
    assert order.turn(GPU1, 0).role is Role.PROFILE, "a size is per GPU"
    assert order.measured(GPU0, 5, 1 * GIB).nbytes == 20 * GIB, "the first size stays"


@pytest.mark.parametrize("size", [None, 0])
def test_without_a_size_the_next_replica_profiles_in_turn(size):
    order = StartOrder()
    order.turn(GPU0, 0), order.turn(GPU0, 1), order.turn(GPU0, 2)
    assert order.measured(GPU0, 0, size) is None
    assert order.turn(GPU0, 1).role is Role.PROFILE
    assert order.turn(GPU0, 2).role is Role.WAIT


def test_a_size_the_user_gave_needs_no_order():
    assert orders_starts(True, {"dtype": "bfloat16"})
    assert not orders_starts(True, {"kv_cache_memory_bytes": 4 * GIB})
    assert not orders_starts(False, {})


# ---------------------------------------------------------------------- the gates on a loop
class Replica:
    """A replica stand-in: its engine logs the KV size ``size_after`` s into its start and
    serves ``start_s`` s after the start began."""

    def __init__(self, log, rid, start_s=0.2, size_after=0.05, size=8 * GIB, fail=False):
        self.log, self.rid, self.start_s = log, rid, start_s
        self.size_after, self.size, self.fail = size_after, size, fail
        self.started = asyncio.Event()
        self.over = False

    async def start(self, kv_bytes, report):
        self.log.append(("start", self.rid, kv_bytes, report))
        self.started.set()
        try:
            await asyncio.sleep(self.start_s)
            if self.fail:
                raise ReplicaStartupError(f"replica {self.rid}: out of memory")
        finally:
            self.over = True
        self.log.append(("ready", self.rid))
        return self.rid

    async def watch(self):
        await self.started.wait()
        waited = 0.0
        while not self.over:
            if self.size is not None and waited >= self.size_after:
                self.log.append(("sized", self.rid))
                return self.size
            await asyncio.sleep(0.01)
            waited += 0.01
        return None

    async def prepare(self):
        self.log.append(("prepare", self.rid))


def run(gates, replicas, key=GPU0):
    async def main():
        return await asyncio.gather(
            *(gates.start(key, r.rid, r.start, r.watch, r.prepare) for r in replicas),
            return_exceptions=True,
        )

    return asyncio.run(main())


def test_the_others_start_pinned_once_the_first_logs_its_size_before_it_serves():
    log, gates = [], StartGates()
    first = Replica(log, 0, start_s=0.3, size_after=0.05)
    others = [Replica(log, rid, start_s=0.1) for rid in (1, 2)]
    assert run(gates, [first, *others]) == [0, 1, 2]
    assert log[0] == ("start", 0, None, True), "the first starts alone, sized by vLLM"
    assert {e for e in log if e[0] == "prepare"} == {("prepare", 1), ("prepare", 2)}
    sized = log.index(("sized", 0))
    starts = [log.index(("start", rid, 8 * GIB, False)) for rid in (1, 2)]
    assert all(sized < s < log.index(("ready", 0)) for s in starts), log
    pin = gates.order.pins[GPU0]
    assert (pin.nbytes, pin.measured_by) == (8 * GIB, 0) and 0 < pin.after_s < 0.3


def test_a_restart_reuses_the_size_and_waits_for_nobody():
    log, gates = [], StartGates()
    run(gates, [Replica(log, 0), Replica(log, 1)])
    log.clear()
    assert run(gates, [Replica(log, 0, size=None)]) == [0]
    assert log[0] == ("start", 0, 8 * GIB, False)


def test_a_start_that_logs_no_size_opens_the_gpu_to_the_next_profiler():
    log, gates = [], StartGates()
    replicas = [Replica(log, rid, start_s=0.05, size=None) for rid in range(3)]
    assert run(gates, replicas) == [0, 1, 2]
    starts = [e for e in log if e[0] == "start"]
    assert [s[2:] for s in starts] == [(None, True)] * 3, "each sized by vLLM, in turn"
    for rid in (1, 2):
        assert log.index(("ready", rid - 1)) < log.index(("start", rid, None, True)), log


def test_a_failed_first_start_lets_the_next_replica_profile():
    log, gates = [], StartGates()
    out = run(gates, [Replica(log, 0, fail=True, size=None), Replica(log, 1)])
    assert isinstance(out[0], ReplicaStartupError) and out[1] == 1
    assert ("start", 1, None, True) in log
    assert gates.order.pins[GPU0].measured_by == 1


def test_a_cancelled_wait_leaves_no_waiter_behind():
    async def main():
        log, gates = [], StartGates()
        first = Replica(log, 0, start_s=5, size=None)
        one = asyncio.ensure_future(gates.start(GPU0, 0, first.start, first.watch))
        await first.started.wait()
        waiter = Replica(log, 1)
        two = asyncio.ensure_future(gates.start(GPU0, 1, waiter.start, waiter.watch))
        await asyncio.sleep(0.05)
        assert gates.order.waiting == {GPU0: {1}}
        two.cancel()
        one.cancel()
        await asyncio.gather(one, two, return_exceptions=True)
        assert gates.order.waiting == {} and gates.order.profiling == {}

    asyncio.run(main())


# ---------------------------------------------------------------------- the memory bound
def test_replicas_sharing_a_gpu_cannot_ask_for_more_than_their_shares(tmp_path):
    from torchrl_vllm_ext.engine.config import ServiceConfig
    from torchrl_vllm_ext.errors import ConfigurationError

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigurationError, match=r"gpu_memory_utilization=0.8 .* at most 0.475"):
        ServiceConfig(
            model=str(tmp_path), gpus_per_replica=0.5, engine_kwargs={"gpu_memory_utilization": 0.8}
        )
    with pytest.raises(ConfigurationError, match="CUDA contexts"):  # a whole slice: no room
        ServiceConfig(
            model=str(tmp_path), gpus_per_replica=0.5, engine_kwargs={"gpu_memory_utilization": 0.5}
        )
    ServiceConfig(
        model=str(tmp_path), gpus_per_replica=0.5, engine_kwargs={"gpu_memory_utilization": 0.475}
    )
    ServiceConfig(model=str(tmp_path), engine_kwargs={"gpu_memory_utilization": 0.95})
