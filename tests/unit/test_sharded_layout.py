"""The plain logic of sharded pushes: which block each rank holds and writes, the names a
push sends, its route, the balance of the checksum pass, the buckets of the gather."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from torchrl_vllm_ext.errors import ShardedPushError, TransportCapabilityError, WeightSyncError
from torchrl_vllm_ext.extensions import load_class
from torchrl_vllm_ext.weight_sync.sharded.layout import assign, block, describe, region_of
from torchrl_vllm_ext.weight_sync.sharded.plan import ShardedPlan
from torchrl_vllm_ext.weight_sync.sharded.routes import (
    SHARDED_TRANSPORTS,
    pushed_names,
    sharded_route,
)
from torchrl_vllm_ext.weight_sync.sharded.streamed import bucket_plan, header_of
from torchrl_vllm_ext.weight_sync.specs import SlotTarget, TensorSpec, from_json, to_json
from torchrl_vllm_ext.weight_sync.transports import registry


def chunked(full: torch.Tensor, placements, mesh_shape, coordinate) -> torch.Tensor:
    """What torch.chunk gives the rank at ``coordinate``, nested in mesh-dim order."""
    local = full
    for placement, size, coord in zip(placements, mesh_shape, coordinate, strict=True):
        if placement[0] == "shard":
            pieces = torch.chunk(local, size, dim=placement[1])
            dim = placement[1]
            local = pieces[coord] if coord < len(pieces) else local.narrow(dim, 0, 0)
    return local


@pytest.mark.parametrize("seed", range(40))
def test_blocks_are_torch_chunks_and_cover_the_tensor_once(seed):
    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3)))
    mesh_shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 2)))
    placements = tuple(
        ("shard", rng.randrange(len(shape))) if rng.random() < 0.7 else ("replicate",)
        for _ in mesh_shape
    )
    full = torch.arange(torch.Size(shape).numel()).view(shape)
    written = torch.zeros(shape, dtype=torch.long)
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        region, writes = region_of(shape, placements, mesh_shape, coordinate)
        expected = chunked(full, placements, mesh_shape, coordinate)
        assert torch.equal(block(full, region), expected), (placements, coordinate)
        if writes:
            block(written, region).add_(1)
    assert (written == 1).all(), "every element written by exactly one rank"


def test_placements_that_are_not_blocks_are_refused_by_name():
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    assert describe("w", Shard(1)) == ("shard", 1)
    assert describe("w", Replicate()) == ("replicate",)
    for placement in (Partial(), _StridedShard(0, split_factor=2)):
        with pytest.raises(ShardedPushError, match="parameter 'w' is placed as"):
            describe("w", placement)


def test_pushed_names_check_the_served_checkpoint():
    expected = {
        "a": TensorSpec("a", "float32", (2, 3)),
        "b": TensorSpec("b", "float32", (4,)),
    }
    shapes = {"a": ((2, 3), "float32"), "b": ((4,), "float32")}
    assert pushed_names({**shapes, "lm_head.weight": ((2, 3), "float32")}, expected) == ["a", "b"]
    with pytest.raises(WeightSyncError, match="'b' is missing"):
        pushed_names({"a": shapes["a"]}, expected)
    with pytest.raises(WeightSyncError, match="'c' is not in the served checkpoint"):
        pushed_names({**shapes, "c": ((1,), "float32")}, expected)
    with pytest.raises(WeightSyncError, match=r"'b' has shape \(5,\)"):
        pushed_names({**shapes, "b": ((5,), "float32")}, expected)
    with pytest.raises(WeightSyncError, match="'a' has dtype int64"):
        pushed_names({**shapes, "a": ((2, 3), "int64")}, expected)


def test_every_cpu_transport_takes_a_sharded_push_and_the_rest_is_refused_by_name():
    assert SHARDED_TRANSPORTS == registry.names(cpu=True, composite=False)
    for name in SHARDED_TRANSPORTS:
        sender = object.__new__(load_class(registry.TRANSPORTS[name].sender))
        assert sharded_route(sender) is sender  # its capability: itself, typed
    for name in set(registry.names()) - set(SHARDED_TRANSPORTS):
        sender = object.__new__(load_class(registry.TRANSPORTS[name].sender))
        with pytest.raises(TransportCapabilityError, match=f"transport {name!r}") as e:
            sharded_route(sender)
        assert e.value.transport == name
        assert e.value.capabilities == ("WrittenByRanks", "Streamed")
        assert "transport='storage'" in str(e.value)


def test_checksums_are_shared_by_bytes():
    owners = assign([100, 60, 50, 10, 10, 10], 3)
    load = [0, 0, 0]
    for size, owner in zip([100, 60, 50, 10, 10, 10], owners, strict=True):
        load[owner] += size
    assert max(load) == 100 and sorted(load) == [70, 70, 100]
    assert assign([5], 4) == [0] and assign([], 2) == []


def test_the_gather_buckets_follow_the_packing_layout():
    specs = (
        TensorSpec("a", "float32", (4,)),
        TensorSpec("b", "bfloat16", (2, 2)),
        TensorSpec("c", "float32", (8,)),
    )
    buckets = bucket_plan(specs, bucket_bytes=20)
    assert buckets == ((0,), (2,), (1,))  # dtype groups in order; c (32 B) alone
    header = header_of(specs, buckets, "7")
    assert header.checksums_follow and header.version == "7"
    assert [b.nbytes for b in header.buckets] == [16, 32, 8]
    assert [t.name for b in header.buckets for t in b.tensors] == ["a", "c", "b"]


def test_the_plan_crosses_the_ranks_as_json_and_names_its_route():
    specs = (TensorSpec("a", "bfloat16", (2, 3)), TensorSpec("b", "bfloat16", (4,)))
    written = ShardedPlan("5", specs, 40, (1, 2), "bfloat16", slot=SlotTarget("B", "/s/B"))
    text = to_json(written)
    assert from_json(text, ShardedPlan) == written and written.written
    manifest = written.manifest({"a": 7, "b": 9})
    assert (manifest.version, manifest.slot) == ("5", "B")
    assert [(t.name, t.dtype, t.shape, t.checksum) for t in manifest.tensors] == [
        ("a", "bfloat16", (2, 3), 7),
        ("b", "bfloat16", (4,), 9),
    ]
    streamed = ShardedPlan("5", specs, 40, buckets=bucket_plan(specs, 1 << 20))
    again = from_json(to_json(streamed), ShardedPlan)
    assert again == streamed and not again.written and again.buckets == ((0, 1),)
    assert again.header().buckets[0].nbytes == 20
    with pytest.raises(ValueError, match="tensors"):
        from_json('{"version": "5", "nbytes": 1}', ShardedPlan)


def test_the_ranks_agree_on_one_layout_one_version_and_finite_shards():
    from torchrl_vllm_ext.weight_sync.sharded.push import agree

    def layout(digest="d", version=None, bad=None):
        return {"digest": digest, "version": version, "bad": bad, "module": True}

    assert agree([layout(), layout(version="3")]) == "3"  # one rank names it: every rank
    assert agree([layout(), layout()]) is None  # none: rank 0 picks TorchRL's next
    with pytest.raises(ShardedPushError, match=r"rank\(s\) \[1\] pushed parameters") as e:
        agree([layout(), layout(digest="other"), layout()])
    assert e.value.ranks == (1,)
    with pytest.raises(ShardedPushError, match=r"different versions \['3', '4'\]") as e:
        agree([layout(version="3"), layout(version="4")])
    assert e.value.ranks == (0, 1)
    with pytest.raises(ShardedPushError, match="rank 2: parameter 'w' contains NaN") as e:
        agree([layout(), layout(), layout(bad="parameter 'w' contains NaN or inf")])
    assert e.value.ranks == (2,)


def test_the_handoff_keeps_two_buckets_alive_and_drops_the_rest_once_the_push_ended():
    import threading

    from torchrl_vllm_ext.weight_sync.sharded.streamed import Handoff

    alive, most = [0], [0]
    lock = threading.Lock()

    def buckets(n):
        for i in range(n):
            with lock:
                alive[0] += 1
                most[0] = max(most[0], alive[0])
            yield torch.full((4,), i)

    handoff = Handoff()
    sent = []

    def send():
        for bucket in handoff.taken():
            sent.append(int(bucket[0]))
            with lock:
                alive[0] -= 1

    sender = threading.Thread(target=send)
    sender.start()
    handoff.feed(buckets(6), ended=lambda: False)
    sender.join(timeout=10)
    assert sent == list(range(6)) and most[0] <= 2

    gathered = []  # a push that ended: the gathers go on (lockstep), nothing is queued
    Handoff().feed((gathered.append(i) for i in range(3)), ended=lambda: True)
    assert gathered == [0, 1, 2]
