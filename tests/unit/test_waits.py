"""The senders' one STAGED_READY poll loop (transports/waits.py), over a scripted fleet:
staging transports leave a dead replica out, broadcast fails on one, a send in flight is
waited for (and its failure ends the wait at once), and the limit names who is late."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from torchrl_vllm_ext.engine.calls import Outcomes
from torchrl_vllm_ext.engine.fleet import ReplicaView
from torchrl_vllm_ext.errors import ReplicaDeadError, WeightSyncError
from torchrl_vllm_ext.weight_sync.transports.waits import wait_staged


def view(rid: int) -> ReplicaView:
    return ReplicaView(rid, None, SimpleNamespace(node_ip="node", pid=100 + rid))


class ScriptedFleet:
    """``call_all`` answers each poll from ``script`` (one Outcomes per poll, the last one
    repeated) and counts the polls."""

    def __init__(self, *script: Outcomes):
        self.script = list(script)
        self.polls = 0

    async def call_all(self, method, *args, replicas=None, deadline=None):
        self.polls += 1
        answer = self.script[min(self.polls, len(self.script)) - 1]
        ids = {r.replica_id for r in replicas}
        return Outcomes(
            {k: v for k, v in answer.results.items() if k in ids},
            {k: v for k, v in answer.errors.items() if k in ids},
            {k: v for k, v in answer.dead.items() if k in ids},
        )


def wait(fleet, replicas, limit_s=5.0, **kwargs):
    return asyncio.run(wait_staged(fleet, replicas, "7", limit_s, 1.0, **kwargs))


def test_polls_until_every_worker_staged_and_leaves_a_dead_replica_out():
    fleet = ScriptedFleet(
        Outcomes({0: [True, False], 1: [True]}),
        Outcomes({0: [True, True]}, dead={1: ReplicaDeadError("gone")}),
    )
    staged = wait(fleet, [view(0), view(1)])
    assert [r.replica_id for r in staged] == [0] and fleet.polls == 2


def test_a_failed_staging_fails_the_push():
    fleet = ScriptedFleet(Outcomes({0: [True]}, errors={1: RuntimeError("bad bucket")}))
    with pytest.raises(WeightSyncError, match="stage of version 7 failed on replica 1"):
        wait(fleet, [view(0), view(1)])


def test_the_limit_names_the_replicas_still_staging():
    fleet = ScriptedFleet(Outcomes({0: [True], 1: [False]}))
    with pytest.raises(WeightSyncError, match=r"replica\(s\) \[1\] did not stage version 7"):
        wait(fleet, [view(0), view(1)], limit_s=0.05)


def test_a_check_that_refuses_the_dead_fails_the_push():
    def no_dead(outcomes, version):
        if outcomes.dead:
            raise WeightSyncError(f"replica(s) {sorted(outcomes.dead)} died during {version}")

    fleet = ScriptedFleet(Outcomes({0: [True]}, dead={1: ReplicaDeadError("gone")}))
    with pytest.raises(WeightSyncError, match=r"\[1\] died during 7"):
        wait(fleet, [view(0), view(1)], check=no_dead)


def test_a_send_in_flight_is_waited_for_and_its_failure_ends_the_wait():
    async def run(send_error):
        fleet = ScriptedFleet(Outcomes({0: [True]}))

        async def send():
            await asyncio.sleep(0.3)
            if send_error:
                raise send_error

        sending = asyncio.ensure_future(send())
        staged = await wait_staged(fleet, [view(0)], "7", 5.0, 1.0, sending=sending)
        return staged, sending, fleet.polls

    staged, sending, polls = asyncio.run(run(None))
    assert sending.done() and staged == [view(0)] and polls >= 2  # heartbeats meanwhile
    staged, sending, _ = asyncio.run(run(OSError("peer closed")))
    assert isinstance(sending.exception(), OSError)  # the caller reads it
