"""The buffers a push keeps from push to push, and its checks as batched reductions: the
trainer's packed buckets (A/B sets re-packed in place; CUDA IPC handles shared once, mappings
kept by the workers), the workers' staging buffer (reserved once; where it goes, sleep mode
included), broadcast receive buffers, and checksums / finiteness with one host sync."""

from __future__ import annotations

import pytest
import torch

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.weight_sync.loading.staging import (
    GIB,
    StagingArea,
    headroom,
    staging_place,
)
from torchrl_vllm_ext.weight_sync.params import (
    checksum,
    device_checksums,
    require_all_finite,
    validate,
)
from torchrl_vllm_ext.weight_sync.specs import CudaIpcHandle, TensorSpec
from torchrl_vllm_ext.weight_sync.transports.broadcast.receiver import _buffer
from torchrl_vllm_ext.weight_sync.transports.ipc.handles import OpenedBuckets, SharedBuckets
from torchrl_vllm_ext.weight_sync.transports.packing import pack
from torchrl_vllm_ext.weight_sync.transports.versions import PackedVersions


def weights(seed: float, dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {
        "a": torch.full((3, 4), seed, dtype=dtype),
        "b": torch.arange(5, dtype=dtype) + seed,
        "h": torch.full((2,), seed, dtype=torch.bfloat16),
    }


# ---------------------------------------------------------------------- packed buckets
def test_repacking_in_place_equals_a_fresh_pack():
    first = pack(weights(1.0), "1", bucket_bytes=32)
    again = pack(weights(2.0), "2", bucket_bytes=32, into=first)
    fresh = pack(weights(2.0), "2", bucket_bytes=32)
    assert again.buffers is first.buffers
    assert again.header == fresh.header  # the same layout and checksums
    for a, b in zip(again.buffers, fresh.buffers, strict=True):
        assert torch.equal(a, b)


def test_a_new_layout_is_packed_into_new_buffers():
    first = pack(weights(1.0), "1")
    other = pack({**weights(1.0), "a": torch.zeros(4, 4)}, "2", into=first)
    assert other.buffers is not first.buffers
    assert other.tensors()["a"].shape == (4, 4)


def push(versions: PackedVersions, seed: float, version: str, commit: bool = True):
    """One push through ``versions``: packed, staged, then committed or rolled back."""
    packed = versions.pack(weights(seed), version)
    versions.stage(packed)
    versions.commit() if commit else versions.rollback()
    return packed


def test_two_sets_alternate_and_the_committed_one_stays_intact():
    versions = PackedVersions()
    seen = []
    for version in range(1, 6):
        committed = versions.committed
        packed = versions.pack(weights(float(version)), str(version))
        assert committed is None or packed.buffers is not committed.buffers
        if committed is not None:  # the live version's bytes are untouched by this push
            assert committed.tensors()["b"][0].item() == float(version - 1)
        seen.append(id(packed.buffers))
        versions.stage(packed)
        versions.commit()
        assert versions.committed is packed and versions.staged is None
    assert len(set(seen)) == 2, "two sets, reused alternately"


def test_a_rolled_back_push_leaves_the_committed_set_and_reuses_its_own():
    versions = PackedVersions()
    live = push(versions, 1.0, "1")
    failed = push(versions, 2.0, "2", commit=False)
    assert versions.committed is live and versions.staged is None
    retry = push(versions, 3.0, "3")
    assert retry.buffers is failed.buffers and live.tensors()["b"][0].item() == 1.0


def test_without_memory_for_two_sets_the_spare_is_dropped():
    versions = PackedVersions(keep_spare=lambda nbytes, device: False)
    a = push(versions, 1.0, "1")
    b = push(versions, 2.0, "2")  # a's set is dropped at this commit
    c = push(versions, 3.0, "3")
    assert c.buffers is not a.buffers and c.buffers is not b.buffers


def test_a_push_that_keeps_no_copy_leaves_nothing_committed():
    """A streamed broadcast stages nothing here: a restarted replica waits for the next push."""
    versions = PackedVersions()
    push(versions, 1.0, "1")
    versions.stage(None)
    versions.commit()
    assert versions.committed is None
    versions.clear()
    assert versions.committed is None and versions.staged is None


# ---------------------------------------------------------------------- CUDA IPC handles
def handle(i: int, numel: int = 8) -> CudaIpcHandle:
    return CudaIpcHandle(
        "gpu-0", numel, 0, "torch.storage.UntypedStorage", f"mem{i}", numel, 0, "r", 0, "", False
    )


def test_the_trainer_shares_each_set_once_per_receiving_process():
    """One share per process: torch's IPC reference counter of a share starts at 1 and
    the process that maps it counts it down once."""
    shared, shares = SharedBuckets(), []

    def fake_share(buf):
        shares.append(buf)
        return handle(len(shares))

    a = [torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)]
    b = [torch.zeros(8, dtype=torch.uint8)]
    r0 = "node:100"  # a replica process (ReplicaView.process)
    for _ in range(3):
        first, second = shared.handles(a, r0, fake_share), shared.handles(b, r0, fake_share)
    assert len(shares) == 3 and first != second
    other = shared.handles(a, "node:200", fake_share)  # another replica: its own share
    restarted = shared.handles(a, "node:300", fake_share)  # replica 0 in a new process
    assert len(shares) == 7 and len({first, other, restarted}) == 3
    del b  # a freed set's entry goes; a new set is shared anew
    shared.handles([torch.zeros(8, dtype=torch.uint8)], r0, fake_share)
    assert len(shares) == 8


def test_workers_keep_the_mappings_of_both_sets():
    opened = OpenedBuckets(lambda h: torch.zeros(h.numel, dtype=torch.uint8))
    set_a, set_b = [handle(0), handle(1)], [handle(2), handle(3)]
    maps = [opened.open(s) for s in (set_a, set_b, set_a, set_b, set_a)]
    assert opened.opened == 4, "each bucket mapped once"
    assert maps[0][0] is maps[2][0] is maps[4][0]
    opened.open([handle(9)])  # a new layout: set_a is in neither of the last two updates
    assert len(opened) == 3 and opened.opened == 5
    opened.clear()
    assert len(opened) == 0


# ---------------------------------------------------------------------- staging
def test_staging_goes_to_the_device_when_it_keeps_the_headroom():
    total = 141 * GIB  # the H200 of the issue: 1.21 GB with ~8 GB free
    assert headroom(total) == total // 50
    assert staging_place(1_210_000_000, 8 * GIB, total) == "device"
    assert staging_place(1_210_000_000, 3 * GIB, total) == "pinned"
    assert staging_place(1_210_000_000, 3 * GIB, total, held_bytes=1_210_000_000) == "device"
    assert staging_place(1_210_000_000, 100 * GIB, total, sleep_mode=True) == "pinned"
    # Tensor parallel: every worker stages the whole push; 8 pinned copies of 140 GB do not
    # fit a host with 1 TB free (half of it at most), 8 of 1.2 GB do.
    big, host = 140 * GIB, 1000 * GIB
    assert staging_place(big, 7 * GIB, total, host_free_bytes=host, copies_on_host=8) == "mapped"
    assert staging_place(big, 7 * GIB, total, host_free_bytes=host, copies_on_host=1) == "pinned"
    small = 1_210_000_000
    assert staging_place(small, GIB, total, host_free_bytes=host, copies_on_host=8) == "pinned"
    assert (  # a sleep-mode replica never stages on the GPU, but may read the slot
        staging_place(
            big, 100 * GIB, 1000 * GIB, sleep_mode=True, host_free_bytes=host, copies_on_host=8
        )
        == "mapped"
    )


def test_the_staging_area_is_reserved_once_per_layout_and_filled_in_place():
    area = StagingArea()
    w = weights(1.0)
    specs = [(n, tuple(t.shape), t.dtype) for n, t in w.items()]
    cpu = torch.device("cpu")
    assert area.reserve(specs, "device", cpu) is True
    buffer = area.buffer
    for seed in (2.0, 3.0):
        assert area.reserve(specs, "device", cpu) is False
        staged = dict(area.fill(weights(seed)))
        assert area.buffer is buffer
        for name, t in weights(seed).items():
            assert torch.equal(staged[name], t)
            assert staged[name].untyped_storage().data_ptr() == buffer.data_ptr()
    for view in area.views.values():  # aligned in the buffer (CUDA's allocator aligns it)
        assert (view.data_ptr() - buffer.data_ptr()) % 256 == 0
    other = [("a", (2, 2), torch.float32)]
    assert area.reserve(other, "device", cpu) is True and area.buffer is not buffer
    assert area.device_bytes() == area.nbytes
    area.release()
    assert area.nbytes == 0 and area.device_bytes() == 0


# ---------------------------------------------------------------------- receive buffers
def test_broadcast_receive_buffers_are_kept_while_their_sizes_hold():
    kept: list[torch.Tensor] = []
    cpu = torch.device("cpu")
    first = [_buffer(kept, i, n, cpu) for i, n in enumerate((16, 32))]
    second = [_buffer(kept, i, n, cpu) for i, n in enumerate((16, 32))]
    assert all(a is b for a, b in zip(first, second, strict=True))
    third = _buffer(kept, 1, 64, cpu)
    assert third is not first[1] and kept[1] is third and kept[0] is first[0]


# ---------------------------------------------------------------------- batched checks
def test_batched_checksums_equal_the_numpy_ones():
    ts = [
        torch.arange(13, dtype=torch.uint8),
        torch.randn(7, 3),
        torch.ones(2, dtype=torch.bfloat16),
    ]
    assert device_checksums(ts) == [checksum(t) for t in ts]
    assert device_checksums([]) == []


def test_batched_finiteness_names_the_first_bad_tensor():
    good = {"a": torch.ones(3), "b": torch.zeros(0), "c": torch.ones(2, dtype=torch.bfloat16)}
    require_all_finite(good)
    bad = {**good, "d": torch.tensor([1.0, float("inf")]), "e": torch.tensor([float("nan")])}
    with pytest.raises(WeightSyncError, match="parameter 'd' contains NaN or inf"):
        require_all_finite(bad)


def test_validate_checks_finiteness_in_one_batch():
    expected = {
        n: TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape))
        for n, t in weights(1.0).items()
    }
    assert list(validate(weights(1.0), expected)) == list(expected)
    broken = {**weights(1.0), "b": torch.tensor([0.0, 1, 2, 3, float("nan")])}
    with pytest.raises(WeightSyncError, match="'b' contains NaN"):
        validate(broken, expected)
    validate(broken, expected, check_finite=False)  # left to the transport's copy pass


# ---------------------------------------------------------------------- the IPC sender's shares
class _Handle:
    """A replica actor handle whose ``collective_rpc`` records the IPC updates it gets."""

    def __init__(self, got: list):
        self.collective_rpc = self
        self.got = got

    def remote(self, method, args=()):
        async def answer():
            self.got.append((method, *args))
            return [True]

        return answer()


class _Fleet:
    """The ready replicas and the two ways a transport calls them (a unit-test stand-in)."""

    uses_gpu, workers_per_replica = True, 1

    def __init__(self, views):
        self.views = views

    def ready(self):
        return tuple(self.views)

    async def call_each(self, call, replicas=None, what="call", timeout=None, deadline=None):
        from torchrl_vllm_ext.engine.calls import Outcomes

        return Outcomes(results={r.replica_id: await call(r) for r in replicas or self.views})

    async def call_all(self, method, *args, replicas=None, timeout=None, deadline=None):
        return await self.call_each(
            lambda r: getattr(r.handle, method).remote(*args), replicas, method
        )


def test_each_ipc_replica_process_gets_its_own_share_kept_from_push_to_push(monkeypatch):
    """The CUDA-only steps (share, synchronize) stood in: which process gets which handles."""
    import asyncio
    from types import SimpleNamespace

    from torchrl_vllm_ext.engine.fleet import ReplicaView
    from torchrl_vllm_ext.extensions import WorkerMethods
    from torchrl_vllm_ext.weight_sync.specs import IpcUpdate, from_json
    from torchrl_vllm_ext.weight_sync.transports.ipc import sender
    from torchrl_vllm_ext.weight_sync.transports.protocol import TransportOptions

    shares = []

    def fake_share(buf):
        shares.append(buf)
        return handle(len(shares), buf.numel())

    monkeypatch.setattr(sender, "share", fake_share)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    got: dict[int, list] = {0: [], 1: []}

    def view(rid, pid):
        return ReplicaView(rid, _Handle(got[rid]), SimpleNamespace(node_ip="node", pid=pid))

    views = [view(0, 100), view(1, 101)]
    transport = sender.IpcTransport(_Fleet(views), TransportOptions())

    def updates(rid):
        staged = [
            a for m, *a in got[rid] if m in (WorkerMethods.STAGE_IPC, WorkerMethods.RECEIVE_IPC)
        ]
        return [from_json(a[0], IpcUpdate).handles for a in staged]

    async def push(version, packed):
        await transport.prepare({}, version, list(views), packed=packed)
        await transport.commit(version)

    packed = pack(weights(1.0), "1", bucket_bytes=32)
    asyncio.run(push("1", packed))
    asyncio.run(push("2", pack(weights(2.0), "2", bucket_bytes=32, into=packed)))
    n = len(packed.buffers)
    assert len(shares) == 2 * n, "one share per bucket and replica process, kept"
    assert updates(0)[0] == updates(0)[1] and updates(1)[0] == updates(1)[1]
    assert updates(0)[0] != updates(1)[0]
    views[0] = view(0, 200)  # replica 0 restarted: a new process
    asyncio.run(transport.bring_up(views[0], "2"))
    assert len(shares) == 3 * n and updates(0)[-1] not in updates(1)
