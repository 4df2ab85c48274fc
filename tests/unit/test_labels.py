"""A replica never serves under a version whose weights it does not hold (issue 49): the
labels' rules, and the pool's decision for a started replica, on stand-ins (no vLLM, no
Ray). The same on real replicas: tests/integration/test_version_labels.py."""

from __future__ import annotations

import asyncio

import pytest
from safetensors.torch import save_file

from torchrl_vllm_ext.engine.config import ServiceConfig
from torchrl_vllm_ext.engine.fleet import ReplicaState, ReplicaView
from torchrl_vllm_ext.engine.labels import WeightLabels, held_refusal
from torchrl_vllm_ext.errors import NoHealthyReplicaError
from torchrl_vllm_ext.messages import ReplicaInfo
from torchrl_vllm_ext.testing.stand_in_pool import StandInPool


def test_a_replica_that_loaded_nothing_holds_the_checkpoint_under_its_label():
    labels = WeightLabels.at_launch("0")
    assert labels.holds_live(None) and labels.label_of(None) == "0"
    pushed = labels.pushed("3")
    assert not pushed.holds_live(None), "the live weights are pushed ones"
    assert pushed.holds_live("3") and not pushed.holds_live("2")
    assert pushed.label_of(None) == "0" and pushed.label_of("3") == "3"
    assert pushed.admit("3", allow_mixed=False, live_served=True) == "ready"
    assert pushed.admit(None, allow_mixed=False, live_served=True) == "held"
    assert pushed.admit(None, allow_mixed=True, live_served=True) == "mixed", "opted in"
    # Nobody serves version 3 any more: the live label follows what the replicas hold.
    assert pushed.admit(None, allow_mixed=False, live_served=False) == "fall_back"
    assert pushed.fallen_back() == WeightLabels.at_launch("0")


def test_a_label_set_by_hand_names_the_checkpoint_only_while_nothing_was_pushed():
    relabelled = WeightLabels.at_launch("0").relabelled("base")
    assert relabelled == WeightLabels("base", "base", live_is_checkpoint=True)
    over_pushed = WeightLabels.at_launch("0").pushed("3").relabelled("7")
    assert over_pushed == WeightLabels("7", "0", live_is_checkpoint=False)
    assert not over_pushed.holds_live(None)
    # A push never makes the live weights the checkpoint's again, even under its label.
    assert not WeightLabels.at_launch("0").pushed("0").holds_live(None)


def test_the_restart_note_says_what_a_restarted_replica_serves():
    pushed = WeightLabels.at_launch("0").pushed("3")
    assert pushed.restart_note(can_bring_up=True, allow_mixed=False) == "at weight version 3"
    held = pushed.restart_note(can_bring_up=False, allow_mixed=False)
    assert "labelled '0'" in held and "takes no requests" in held
    assert "beside version '3'" in pushed.restart_note(can_bring_up=False, allow_mixed=True)


def test_only_held_replicas_and_nothing_starting_is_refused_at_once():
    held, ready = ReplicaState.HELD, ReplicaState.READY
    with pytest.raises(NoHealthyReplicaError, match=r"replicas \[0, 2\] .*Push again"):
        raise held_refusal("svc", {0: held, 2: held}, "3")
    for waiting in (ReplicaState.STARTING, ReplicaState.DEAD, ready):
        assert held_refusal("svc", {0: held, 1: waiting}, "3") is None
    assert held_refusal("svc", {0: ReplicaState.STOPPED}, "3") is None


# ---------------------------------------------------------------------- the pool
class Actor:
    """A stand-in replica actor: the version label its provider gives it."""

    def __init__(self, version: str):
        self.version = version


class Provider:
    """A stand-in weights provider (a scheme): loads its version, or nothing once closed."""

    def __init__(self, version: str | None, loads: bool = True):
        self.version, self.loads, self.brought = version, loads, []

    async def bring_up(self, replica: ReplicaView) -> str | None:
        self.brought.append(replica.replica_id)
        if not self.loads:
            return None
        replica.handle.version = self.version
        return self.version


@pytest.fixture
def model_dir(tmp_path):
    import torch

    save_file({"model.w": torch.ones(2, 2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"vocab_size": 64}')
    return tmp_path


def pool_of(model_dir, n: int, **config) -> StandInPool:
    pool = StandInPool(ServiceConfig(model=str(model_dir), **config), "svc")
    for rid in range(n):
        info = ReplicaInfo(rid, 0, "127.0.0.1", 256, 100, 4096)
        pool.adopt(ReplicaView(rid, Actor(pool.admission.labels.checkpoint), info))
    return pool


async def start_again(pool: StandInPool, rid: int) -> ReplicaState:
    """What the pool does with a replica whose engine just (re)started: its provider step,
    then READY or HELD (the Ray part of a start left out)."""
    rec = pool.records.get(rid)
    pool.records.set_state(rec, ReplicaState.STARTING)
    rec.actor = Actor(pool.admission.labels.checkpoint)  # a fresh engine holds the checkpoint
    pool.admission.admit(rec, await pool.admission.bring_to_service(rec.view()))
    return pool.states()[rid]


def test_a_replica_started_after_the_scheme_closed_is_held_until_a_push(model_dir):
    async def run():
        pool = pool_of(model_dir, 2)
        scheme = Provider("3")
        pool.set_provider(scheme)  # a push committed version 3
        assert pool.weight_version == "3"
        assert await start_again(pool, 1) is ReplicaState.READY, "the scheme brings it up"
        assert pool.records.get(1).actor.version == "3"

        pool.set_provider(None)  # scheme.close()
        assert await start_again(pool, 1) is ReplicaState.HELD
        assert [v.replica_id for v in pool.ready()] == [0], "held: routed nowhere"
        assert pool.records.get(1).actor.version == "0", "labelled as what it holds"

        # Every replica held and nothing starting: a request is refused at once.
        pool.records.set_state(pool.records.get(0), ReplicaState.HELD)
        with pytest.raises(NoHealthyReplicaError, match="held"):
            await asyncio.wait_for(pool.wait_ready(), 1.0)

        # A push with a new scheme brings every held replica to its version.
        pool.set_provider(Provider("4"))
        await asyncio.gather(*pool._tasks)
        assert dict(pool.states()) == {0: ReplicaState.READY, 1: ReplicaState.READY}
        assert {v.handle.version for v in pool.ready()} == {"4"}

    asyncio.run(run())


def test_once_no_replica_serves_the_live_version_the_checkpoint_is_live(model_dir):
    async def run():
        pool = pool_of(model_dir, 2)
        pool.set_provider(Provider("3"))
        pool.set_provider(None)
        assert await start_again(pool, 1) is ReplicaState.HELD
        assert await start_again(pool, 0) is ReplicaState.READY, "nobody serves 3 any more"
        assert dict(pool.states()) == {0: ReplicaState.READY, 1: ReplicaState.READY}
        assert pool.admission.labels == WeightLabels.at_launch("0") and pool.weight_version == "0"
        assert {v.handle.version for v in pool.ready()} == {"0"}, "the labels hold"

    asyncio.run(run())


def test_a_provider_that_loaded_nothing_leaves_the_replica_held(model_dir):
    async def run():
        pool = pool_of(model_dir, 2)
        pool.set_provider(Provider("3"))
        pool.provider.loads = False  # closed while the replica started
        assert await start_again(pool, 0) is ReplicaState.HELD

    asyncio.run(run())


def test_mixed_versions_serve_under_the_checkpoints_label_when_allowed(model_dir):
    async def run():
        pool = pool_of(model_dir, 2, allow_mixed_versions=True)
        pool.set_provider(Provider("3"))
        pool.set_provider(None)
        assert await start_again(pool, 1) is ReplicaState.READY
        assert {v.replica_id: v.handle.version for v in pool.ready()} == {0: "0", 1: "0"}

    asyncio.run(run())


def test_a_label_set_by_hand_follows_a_restart_only_over_the_checkpoint(model_dir):
    async def run():
        pool = pool_of(model_dir, 2)
        pool.admission.relabel("base")  # nothing pushed: the label names the checkpoint
        assert await start_again(pool, 0) is ReplicaState.READY
        assert pool.records.get(0).actor.version == "base"
        pool.set_provider(Provider("3"))
        pool.admission.relabel("7")  # over pushed weights: a restart cannot hold them
        assert await start_again(pool, 0) is ReplicaState.HELD
        assert pool.records.get(0).actor.version == "base"

    asyncio.run(run())


def test_closing_a_pool_of_stand_ins_forgets_them_without_stopping_them(model_dir):
    async def run():
        pool = pool_of(model_dir, 2)
        await pool.close()  # a stand-in has no Ray actor to shut down or kill
        assert pool.ready() == () and dict(pool.states()) == {}
        assert pool.launcher.adopted == []

    asyncio.run(run())
