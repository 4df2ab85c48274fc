"""Delta pushes, as plain data: the encoding and its threshold, the served-dtype slots (a
killed writer's half-written slot), and when a scheme sends deltas.
The pushes on real replicas: tests/integration/test_delta.py."""

from __future__ import annotations

import pytest
import torch

from torchrl_vllm_ext import ConfigurationError, WeightSyncError
from torchrl_vllm_ext.weight_sync import delta as d
from torchrl_vllm_ext.weight_sync.transport_choice import delta_dtype
from torchrl_vllm_ext.weight_sync.transports.packing import pack
from torchrl_vllm_ext.weight_sync.transports.storage.slots import SlotReader, SlotWriter
from torchrl_vllm_ext.weight_sync.transports.versions import PackedVersions

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"embed": (64, 16), "q": (16, 16), "norm": (16,), "big": (300, 7), "tiny": (1,)}
    return {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()}


def step(tensors: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    """An Adam-like step: every fp32 value moves by about ``lr``."""
    g = torch.Generator().manual_seed(seed)
    return {n: t + lr * torch.randn(t.shape, generator=g).sign() for n, t in tensors.items()}


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_base_plus_its_delta_is_the_new_version_bit_for_bit(dtype):
    old = pack(model(), "1", bucket_bytes=2000, dtype=dtype)
    new_tensors = step(model(), 1e-5, seed=1)
    new_tensors["norm"] = new_tensors["norm"] + 1.0  # a tensor changed whole
    new_tensors["tiny"] = model()["tiny"]  # one unchanged
    new = pack(new_tensors, "2", bucket_bytes=2000, dtype=dtype)
    assert len(new.buffers) > 1
    for spec, nb, ob in zip(new.header.buckets, new.buffers, old.buffers, strict=True):
        delta, payload, _ = d.diff_and_sum(nb, ob, spec)
        assert payload.numel() == d.payload_bytes(spec, delta)
        held = ob.clone()
        d.apply_bucket(held, spec, delta, payload)
        assert torch.equal(held, nb)


def test_a_mostly_changed_tensor_goes_whole_and_an_unchanged_bucket_sends_nothing():
    old = pack(model(), "1", dtype=torch.bfloat16)
    changed = model()
    changed["q"] = changed["q"] * 2  # every value of q
    changed["embed"][0, :3] += 1.0  # 3 of 1024 values of embed
    new = pack(changed, "2", dtype=torch.bfloat16)
    (spec,) = new.header.buckets
    delta, payload, _ = d.diff_and_sum(new.buffers[0], old.buffers[0], spec)
    assert delta.dense == ((64 * 16, 16 * 16),)  # q, after embed
    assert delta.positions == 3 and delta.index_dtype == "int32"
    assert payload.numel() == d.payload_bytes(spec, delta) < new.nbytes / 4
    same, nothing, _ = d.diff_and_sum(old.buffers[0], old.buffers[0].clone(), spec)
    assert same == d.BucketDelta((), 0) and nothing.numel() == 0


@pytest.mark.parametrize("share", [0.01, 0.2, 0.3, 0.9])
def test_the_threshold_decides_by_the_share_changed(share):
    n = 1000
    old = torch.zeros(n)
    new = old.clone()
    new[: int(share * n)] = 1.0
    from torchrl_vllm_ext.weight_sync.specs import BucketSpec, TensorSpec

    spec = BucketSpec("float32", (TensorSpec("w", "float32", (n,)),), 4 * n, 0)
    delta, _, _ = d.diff_and_sum(new.view(torch.uint8), old.view(torch.uint8), spec)
    whole = share > d.DENSE_SHARE
    assert (delta.dense == ((0, n),)) == whole
    assert delta.positions == (0 if whole else int(share * n))


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.uint8])
def test_changed_positions_agree_with_an_elementwise_comparison(dtype):
    g = torch.Generator().manual_seed(0)
    for n, offset in [(1001, 0), (4096, 0), (333, 1), (7, 0), (3 * d.CHUNK + 3, 0)]:
        old = torch.randint(0, 50, (n + offset,), generator=g).to(dtype)[offset:]
        new = old.clone()
        new[torch.randint(0, n, (n // 20 + 1,), generator=g)] += 1
        assert torch.equal(d.changed_positions(new, old)[0], (new != old).nonzero().squeeze(1))


def test_bits_are_compared_not_values():
    old, new = torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])
    assert d.changed_positions(
        d.words(new.view(torch.uint8), "float32"), d.words(old.view(torch.uint8), "float32")
    )[0].tolist() == [0]


def test_served_dtype_slots_alternate_and_a_killed_write_leaves_readers_on_the_published_one():
    writer = SlotWriter()
    try:
        v = {i: step(model(), 1e-6, seed=i) for i in range(1, 5)}
        writer.write(v[1], "1", dtype=torch.bfloat16)  # slot A
        writer.write(v[2], "2", dtype=torch.bfloat16)  # slot B
        assert writer.written == sum(t.numel() * 2 for t in v[2].values())

        def killed(name, t):  # the writer dies after writing part of slot A
            if name == "big":
                raise RuntimeError("killed")

        with pytest.raises(RuntimeError):
            writer.write(v[3], "3", killed, dtype=torch.bfloat16)
        manifest, tensors = SlotReader(writer.root).read("2")  # verified: still version 2
        assert manifest.slot == "B"
        assert all(torch.equal(tensors[n], v[2][n].to(torch.bfloat16)) for n in v[2])
        writer.write(v[4], "4", dtype=torch.bfloat16)  # into A, whatever A holds
        manifest, tensors = SlotReader(writer.root).read("4")
        assert manifest.slot == "A" and {s.dtype for s in manifest.tensors} == {"bfloat16"}
        assert all(torch.equal(tensors[n], v[4][n].to(torch.bfloat16)) for n in v[4])
    finally:
        writer.close()


def test_a_slot_of_another_dtype_is_refused_by_name():
    writer = SlotWriter()
    try:
        writer.write(model(), "1")
        writer.write(model(), "2")
        with pytest.raises(WeightSyncError, match="new storage directory"):
            writer.write(model(), "3", dtype=torch.bfloat16)
    finally:
        writer.close()


def commit(versions: PackedVersions, packed):
    versions.stage(packed)
    versions.commit()
    return packed


def test_packed_versions_cast_into_the_spare_set():
    versions = PackedVersions()
    a = commit(versions, versions.pack(model(), "1", dtype=torch.bfloat16))
    b = commit(versions, versions.pack(step(model(), 1e-3, 1), "2", dtype=torch.bfloat16))
    c = versions.pack(model(), "3", dtype=torch.bfloat16)
    assert c.buffers is a.buffers and b.buffers is not a.buffers
    assert all(s.dtype == "bfloat16" for s in c.header.buckets)
    assert torch.equal(c.tensors()["q"], model()["q"].to(torch.bfloat16))


def test_which_pushes_are_deltas():
    assert delta_dtype("auto", "storage", "bfloat16") == "bfloat16"
    assert delta_dtype("auto", "broadcast", "float16") == "float16"
    assert delta_dtype("auto", "broadcast", "float32") is None  # every value changes
    assert delta_dtype(True, "broadcast", "float32") == "float32"
    assert delta_dtype(False, "storage", "bfloat16") is None
    assert delta_dtype("auto", "ipc", "bfloat16") is None
    with pytest.raises(ConfigurationError, match="delta=True needs a transport"):
        delta_dtype(True, "ipc", "bfloat16")
    with pytest.raises(ConfigurationError, match="delta='sometimes'"):
        delta_dtype("sometimes", "storage", "bfloat16")


class _Group:
    """A stand-in for the broadcast group: each ``broadcast(buf, 0)`` fills ``buf`` with the
    next buffer the sender sent."""

    def __init__(self, sent):
        self.sent = list(sent)

    def broadcast(self, buf, src):
        buf.copy_(self.sent.pop(0))
        return self

    def wait(self):
        return True


def _receiver(sent):
    from torchrl_vllm_ext.weight_sync.transports.broadcast.collective import JoinedGroup
    from torchrl_vllm_ext.weight_sync.transports.broadcast.receiver import BroadcastReceiver

    receiver = BroadcastReceiver(loads=None)
    receiver.group, receiver.backend, receiver.device = (
        JoinedGroup(None, _Group(sent)),
        "gloo",
        torch.device("cpu"),
    )
    return receiver


def _delta_update(new, base):
    from torchrl_vllm_ext.weight_sync.specs import UpdateHeader

    pairs = [
        d.diff_and_sum(n, o, s)
        for s, n, o in zip(new.header.buckets, new.buffers, base.buffers, strict=True)
    ]
    header = UpdateHeader(
        new.version, new.header.buckets, base=base.version, deltas=tuple(p[0] for p in pairs)
    )
    return header, [p[1] for p in pairs if p[1].numel()]


def test_a_worker_rebuilds_each_version_from_its_buffers_and_refuses_another_base():
    v1 = pack(model(), "1", bucket_bytes=2000, dtype=torch.bfloat16)
    v2 = pack(step(model(), 1e-3, seed=2), "2", bucket_bytes=2000, dtype=torch.bfloat16)
    v3 = pack(step(model(), 1e-3, seed=3), "3", bucket_bytes=2000, dtype=torch.bfloat16)
    receiver = _receiver([b.clone() for b in v1.buffers])
    receiver._receive(v1.header)
    assert receiver.held == "1"
    header, payloads = _delta_update(v2, v1)
    receiver.group.process_group.sent = payloads
    received = receiver._receive(header)
    named = dict(received.named)
    assert receiver.held == "2" and received.changes.base == "1"
    changed = {n for c in received.changes.buckets for n in c.names}
    assert changed and changed <= set(named)  # what the pause scatters (test_load_plan.py)
    assert all(torch.equal(named[n], t) for n, t in v2.tensors().items())
    header, payloads = _delta_update(v3, v1)  # a delta of 1, but the worker holds 2
    receiver.group.process_group.sent = payloads
    with pytest.raises(WeightSyncError, match="buffers hold 2"):
        receiver._receive(header)
    assert not receiver.group.process_group.sent  # every payload was received first
    header, payloads = _delta_update(v3, v2)
    payloads[0][0] ^= 1  # one bit flipped on the way
    receiver.group.process_group.sent = payloads
    with pytest.raises(WeightSyncError, match="after its delta"):
        receiver._receive(header)
    assert receiver.held is None  # nothing whole: the next delta is refused too


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_deltas_checksums_are_its_bases_plus_what_changed(dtype):
    """The sender sums only the changed words (its buckets packed without checksums), and
    they equal the new buckets' checksums; only the changed values are checked for NaN."""
    from torchrl_vllm_ext.weight_sync.params import device_checksums
    from torchrl_vllm_ext.weight_sync.transports.broadcast.sender import BroadcastTransport

    v1 = pack(model(), "1", bucket_bytes=2000, dtype=dtype)
    tensors = model()
    tensors["norm"] = tensors["norm"] + 1.0  # sent whole
    tensors["q"][0, :3] += 0.5  # a few values of two buckets
    tensors["big"][5, 5] += 1.0
    v2 = pack(tensors, "2", bucket_bytes=2000, dtype=dtype, checksums=False)
    header, payloads = BroadcastTransport._delta(v2, v1, checks_finite=True)
    assert header.base == "1" and payloads
    assert [b.checksum for b in header.buckets] == device_checksums(v2.buffers)
    tensors["q"][3, 4] = float("nan")
    v3 = pack(tensors, "3", bucket_bytes=2000, dtype=dtype, checksums=False)
    with pytest.raises(WeightSyncError, match="'q' contains NaN or inf"):
        BroadcastTransport._delta(v3, v1, checks_finite=True)


def test_a_word_shared_by_a_changed_value_and_a_tensor_sent_whole_is_summed_once():
    from torchrl_vllm_ext.weight_sync.params import device_checksums
    from torchrl_vllm_ext.weight_sync.specs import BucketSpec, TensorSpec

    # bf16 "a" (11 values) then "b" (5): word 2 holds a[8:11] and b[0]
    spec = BucketSpec(
        "bfloat16", (TensorSpec("a", "bfloat16", (11,)), TensorSpec("b", "bfloat16", (5,))), 32, 0
    )
    old = torch.arange(16, dtype=torch.bfloat16).view(torch.uint8)
    new = old.clone().view(torch.bfloat16)
    new[9] = 99.0  # one of a's (9%: by position)
    new[11:] = -1.0  # all of b: sent whole
    new = new.view(torch.uint8)
    delta, payload, _ = d.diff_and_sum(new, old, spec)
    assert delta.dense == ((11, 5),) and delta.positions == 1
    _, positions = d.split_payload(spec, delta, payload)
    touched = d.touched_words(spec, delta, positions)
    assert touched.runs == ((2, 4),) and touched.words.numel() == 0
    before, after = d.words_sum(old, touched), d.words_sum(new, touched)
    assert d.checksum_after(device_checksums([old])[0], before, after) == device_checksums([new])[0]


@pytest.mark.parametrize("share", [0.0, 0.001, 0.05, 0.3, 0.9])
def test_sparse_true_positions_equal_nonzero(share):
    g = torch.Generator().manual_seed(int(share * 1000))
    for n in (0, 5, 8, 1001, 100003):
        mask = torch.rand(n, generator=g) < share
        assert torch.equal(d._true_positions(mask), mask.nonzero().squeeze(1)), n
