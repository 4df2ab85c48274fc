"""The logic of service handles without Ray or vLLM: the directory's table and mailbox,
a handle's pool (deaths leave its snapshot and are reported once), owner-only
forwarding, the sync and async forms of one coroutine, and TorchRL's sender shape over a service."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from torchrl_vllm_ext.engine.config import ServiceConfig
from torchrl_vllm_ext.engine.fleet import ReplicaView
from torchrl_vllm_ext.engine.handles.directory import ReplicaDirectory, ReplicaTable
from torchrl_vllm_ext.engine.handles.owner import FORWARDED, owner_only, sync_and_async
from torchrl_vllm_ext.engine.handles.pool import HandlePool
from torchrl_vllm_ext.errors import ConfigurationError, ReplicaDeadError, ServiceClosedError
from torchrl_vllm_ext.messages import ReplicaInfo
from torchrl_vllm_ext.weight_sync.torchrl.script_scheme import ServiceSyncScheme


class _Remote:
    """``obj.method.remote(*args)`` recording its calls (a stand-in for a Ray handle)."""

    def __init__(self):
        self.calls: list = []

    def __getattr__(self, name):
        return SimpleNamespace(remote=lambda *a, **k: self.calls.append((name, a, k)))


def _view(rid: int, pid: int) -> ReplicaView:
    return ReplicaView(rid, _Remote(), ReplicaInfo(rid, pid, "127.0.0.1", 256, 100, 4096))


def _table(seq: int, *views, closed=False) -> ReplicaTable:
    return ReplicaTable(
        seq=seq,
        ready=views,
        states={v.replica_id: "ready" for v in views},
        weight_version=str(seq),
        closed=closed,
    )


def test_directory_keeps_the_newest_table_and_answers_requests():
    async def scenario():
        d = ReplicaDirectory()
        await d.publish(_table(2))
        await d.publish(_table(1))  # an older table never replaces a newer one
        assert (await d.watch(0, 1.0)).seq == 2
        assert await d.watch(2, 0.01) is None  # nothing newer within the timeout
        waiter = asyncio.ensure_future(d.watch(2, 5.0))
        await d.publish(_table(3))
        assert (await waiter).seq == 3
        rid = await d.submit("call", ["payload"])
        await d.submit("death", (0, "a0", "gone", "generate"), reply=False)
        taken = await d.take(1.0)
        assert [(k, p) for _, k, p in taken] == [
            ("call", ["payload"]),
            ("death", (0, "a0", "gone", "generate")),
        ]
        await d.answer(rid, False, ConfigurationError("refused"))
        with pytest.raises(ConfigurationError, match="refused"):
            await d.result(rid)
        await d.publish(_table(4, closed=True))
        with pytest.raises(ServiceClosedError):
            await d.submit("call", [])

    asyncio.run(scenario())


def test_a_handle_drops_a_dead_replica_and_reports_it_once(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    directory = _Remote()
    a, b = _view(0, 100), _view(1, 101)
    pool = HandlePool(ServiceConfig(model=str(tmp_path)), directory, _table(1, a, b))
    err = pool._died(a, RuntimeError("actor died"), "generate")
    assert isinstance(err, ReplicaDeadError) and "replica 0" in str(err)
    pool._died(a, RuntimeError("again"), "generate")
    assert [c[1][0] for c in directory.calls] == ["death"]  # reported once
    assert [v.replica_id for v in pool.ready()] == [1]
    pool.apply(_table(2, a, b))  # the owner has not noticed yet: still out
    assert [v.replica_id for v in pool.ready()] == [1]
    pool.apply(_table(3, _view(0, 102), b))  # restarted: a new actor process
    assert [v.replica_id for v in pool.ready()] == [0, 1] and pool.weight_version == "3"
    with pytest.raises(ConfigurationError, match="owner"):
        pool.when_serving(lambda views: None)


def test_owner_only_runs_on_the_owner_and_forwards_from_a_handle():
    class Svc:
        def __init__(self, owner):
            self.is_owner, self.forwarded = owner, []

        def _forward(self, name, args, kwargs):
            self.forwarded.append((name, args, kwargs))
            return "from the owner"

        @owner_only
        def pause(self, mode="abort"):
            return f"paused {mode}"

        def run(self, coro):
            return asyncio.run(coro)

        async def arun(self, coro):
            return await coro

        async def _label(self, version):
            """Label the replicas."""
            return f"labelled {version}"

        label, alabel = sync_and_async(_label, owner=True)

    assert "pause" in FORWARDED and "label" in FORWARDED
    assert Svc(True).pause("keep") == "paused keep"
    handle = Svc(False)
    assert handle.pause("keep") == "from the owner"
    assert handle.forwarded == [("pause", ("keep",), {})]
    assert Svc(True).label(3) == "labelled 3" and Svc.label.__doc__ == "Label the replicas."
    assert asyncio.run(Svc(True).alabel(4)) == "labelled 4"
    assert asyncio.run(handle.alabel(5)) == "from the owner"


def test_service_sender_pushes_through_the_engine_and_bumps_collectors():
    pushed, inits, bumps = [], [], []
    engine = SimpleNamespace(
        update_weights=lambda it: pushed.append(dict(it)),
        init_weight_update_group=lambda: inits.append(True),
    )
    sender = ServiceSyncScheme(engine).create_sender()
    with pytest.raises(ValueError, match="register_model"):
        sender.update_weights()
    sender.register_model({"model.embed_tokens.weight": torch.ones(2, 2)})
    sender.init_all_workers_group({}, vllm_engine=engine)
    sender.register_collector(SimpleNamespace(increment_version=lambda: bumps.append(1)))
    sender.update_weights()
    assert inits == [True] and bumps == [1]
    assert list(pushed[0]) == ["model.embed_tokens.weight"]
