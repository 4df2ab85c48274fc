"""Per-worker broadcast sends: each worker of a tensor-parallel replica is sent only the
bytes its load plan keeps. The run arithmetic (every element of a worker's slice cut
once, written back at its place), the route's choice with its reason, and two ranks of
a vLLM-shaped sharded model over a real gloo group: each receives exactly its share and
loads bitwise what a whole-tensor broadcast loads; a bad checksum or runs the worker
does not hold are refused by name."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

from tests.unit.test_slices import WORLD, ShardedModel, Worker, perturbed, pushed
from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.listening import listen
from torchrl_vllm_ext.weight_sync.loading.loads import Loads
from torchrl_vllm_ext.weight_sync.loading.plan import layout_of
from torchrl_vllm_ext.weight_sync.loading.slices import TensorSlice, kept_bytes
from torchrl_vllm_ext.weight_sync.specs import PerWorkerUpdate, from_json, to_json
from torchrl_vllm_ext.weight_sync.transports.broadcast.collective import BroadcastGroup
from torchrl_vllm_ext.weight_sync.transports.broadcast.per_worker import (
    BROADCAST,
    PER_WORKER,
    broadcast_reason,
    byte_runs,
    choose_route,
    gather,
    runs_digest,
    scatter,
    worker_runs,
)
from torchrl_vllm_ext.weight_sync.transports.broadcast.receiver import BroadcastReceiver
from torchrl_vllm_ext.weight_sync.transports.broadcast.sender import _cut
from torchrl_vllm_ext.weight_sync.transports.packing import pack, unpack

# ---------------------------------------------------------------- run arithmetic


def random_runs(numel: int, rng: np.random.Generator) -> list[list[int]]:
    """Random disjoint runs of ``numel`` elements (sometimes none, all, or a column
    block)."""
    kind = rng.integers(5)
    if kind == 0:
        return []
    if kind == 1:
        return [[0, numel]]
    if kind == 2 and numel >= 4:  # a column block of every row: equal runs, one step apart
        step = int(rng.integers(2, numel // 2 + 1))
        length = int(rng.integers(1, step))
        first = int(rng.integers(0, step - length + 1))
        return [[a, a + length] for a in range(first, numel - length + 1, step)]
    cuts = np.unique(rng.integers(0, numel + 1, size=6))
    return [[int(a), int(b)] for a, b in zip(cuts[::2], cuts[1::2], strict=False) if b > a]


@pytest.mark.parametrize("seed", range(8))
def test_each_element_of_a_workers_slices_is_cut_once_and_written_back_at_its_place(seed):
    rng = np.random.default_rng(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    tensors = {
        f"t{i}": torch.randn(int(rng.integers(1, 40)), dtype=torch.float64).to(
            dtypes[i % len(dtypes)]
        )
        for i in range(12)
    }
    packed = pack(tensors, "1", bucket_bytes=96)  # several buckets of each dtype
    assert len(packed.header.buckets) > 4
    runs = {name: random_runs(t.numel(), rng) for name, t in tensors.items()}

    cut = byte_runs(packed.header, runs)
    payload = gather(packed.buffers, cut)
    kept = sum((b - a) * tensors[n].element_size() for n, rs in runs.items() for a, b in rs)
    assert payload.numel() == kept  # nothing twice, nothing left out
    assert (np.diff(cut[:, 1:], axis=1) > 0).all()

    into = [torch.zeros_like(b) for b in packed.buffers]
    scatter(payload, cut, into)
    received = dict(
        p for b, buf in zip(packed.header.buckets, into, strict=True) for p in unpack(b, buf)
    )
    for name, t in tensors.items():
        mask = torch.zeros(t.numel(), dtype=torch.bool)
        for a, b in runs[name]:
            mask[a:b] = True
        got = received[name].view(-1)
        assert torch.equal(got[mask], t.view(-1)[mask]), name  # its slice, bitwise
        assert (got[~mask] == 0).all(), name  # nothing outside it


def test_runs_past_a_tensor_are_refused_by_name():
    header = pack({"w": torch.zeros(4)}, "1").header
    with pytest.raises(ValueError, match="runs of w reach past its 4 elements"):
        byte_runs(header, {"w": [[2, 5]]})


def test_a_payload_of_another_size_is_refused():
    buffers = [torch.zeros(8, dtype=torch.uint8)]
    with pytest.raises(ValueError, match="a payload of 3 bytes for runs of 2"):
        scatter(torch.zeros(3, dtype=torch.uint8), np.array([[0, 0, 2]]), buffers)


def test_the_digest_names_the_runs():
    runs = worker_runs({"a": TensorSlice.of(8, [(0, 4)]), "b": TensorSlice.of(2, [])})
    assert runs == {"a": [[0, 4]], "b": []}
    assert runs_digest(runs) == runs_digest(dict(reversed(runs.items())))
    assert runs_digest(runs) != runs_digest({**runs, "b": [[0, 1]]})


# ---------------------------------------------------------------- the route


def test_the_route_and_its_reason():
    assert broadcast_reason("gloo", 1, False) == "one worker per replica keeps every byte"
    assert "gloo only, not nccl" in broadcast_reason("nccl", 2, False)
    assert broadcast_reason("gloo", 2, True).startswith("delta pushes on")
    assert broadcast_reason("gloo", 2, False) is None
    assert "per_worker_sends=False" in broadcast_reason("gloo", 2, False, per_worker_sends=False)
    two = [{"w": [[0, 2]]}, {"w": [[2, 4]]}]
    assert choose_route({0: two, 1: two})[0] == PER_WORKER
    route, why = choose_route({0: two, 1: [two[0], None]})
    assert route == BROADCAST and why.startswith("worker 1 of replica 1 has no load plan")
    assert choose_route({}) == (BROADCAST, "no replica reported its workers' slices")


# ---------------------------------------------------------------- two ranks over gloo


class RankWorker(Worker):
    """A vLLM worker of rank ``rank`` in its replica, holding that rank's shards."""

    def __init__(self, rank: int):
        super().__init__(ShardedModel(rank))
        self.rank = rank


def in_threads(calls):
    """Run every ``call`` in its own thread; their results, re-raising the first error."""
    results, errors = [None] * len(calls), []

    def run(i, call):
        try:
            results[i] = call()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


@pytest.fixture
def group_of_two():
    """The trainer (rank 0) and the two workers of one TP=2 replica, in a gloo group."""
    host = "127.0.0.1"
    listener = listen(host)
    port = listener.getsockname()[1]
    receivers = [BroadcastReceiver(Loads(RankWorker(r))) for r in range(WORLD)]
    joins = [
        (lambda r=r: r.init_weight_broadcast(host, port, 1 + WORLD, 1, "gloo", 60))
        for r in receivers
    ]
    group, *ranks = in_threads(
        [lambda: BroadcastGroup("gloo", host, port, 1 + WORLD, 60, listener), *joins]
    )
    assert ranks == [1, 2]
    yield group, receivers
    group.close()
    for r in receivers:
        r.close_weight_broadcast()


class Replica:
    replica_id = 0
    process = "replica-0"


def whole_push(group, receivers, tensors, version):
    packed = pack(tensors, version, bucket_bytes=256)
    header_json = to_json(packed.header)
    for r in receivers:
        r.stage_weight_broadcast(header_json)
    group.send(packed.buffers)
    return [r.loads.load_staged(version) for r in receivers], packed


def per_worker_push(group, receivers, tensors, version, tamper=lambda update: update):
    packed = pack(tensors, version, bucket_bytes=256)
    header_json = to_json(packed.header)
    reported = {0: [r.weight_broadcast_slices(header_json) for r in receivers]}
    assert choose_route(reported)[0] == PER_WORKER
    updates, sends = _cut(packed.header, packed.buffers, reported, [Replica()], WORLD, {}, {})
    update_json = to_json(tamper(from_json(updates[0], PerWorkerUpdate)))
    for r in receivers:
        r.stage_weight_sends(update_json)
    group.send_each(sends)
    return [r.loads.load_staged(version) for r in receivers], sends


def test_each_worker_receives_exactly_its_share_and_loads_what_a_whole_push_loads(group_of_two):
    group, receivers = group_of_two
    header = pack(pushed(), "0", bucket_bytes=256).header
    assert all(r.weight_broadcast_slices(to_json(header)) is None for r in receivers)  # no plan
    traced, _ = whole_push(group, receivers, pushed(), "1")
    assert [t.path for t in traced] == ["trace"] * WORLD

    reports, sends = per_worker_push(group, receivers, perturbed(1), "2")
    plans = [r.loads.plans.plan(list(perturbed(1).items())) for r in receivers]
    for rank, (report, (dst, payload), plan) in enumerate(zip(reports, sends, plans, strict=True)):
        assert dst == 1 + rank and report.path == "replay"
        assert payload.numel() == report.received_bytes == kept_bytes(plan) < report.nbytes
        assert report.sliced_received_bytes == report.sliced_kept_bytes  # exactly its share
        assert report.whole["norm"].startswith("this worker keeps every element")
        assert report.whole["scale"].startswith("the loader computes from it")
        expected = ShardedModel(rank)
        expected.load_weights(perturbed(1).items())
        got = receivers[rank].loads.worker.model
        for (name, a), (_, b) in zip(
            expected.state_dict().items(), got.state_dict().items(), strict=True
        ):
            assert torch.equal(a, b), (rank, name)

    # A whole broadcast after it is loaded from whole buffers again.
    again, _ = whole_push(group, receivers, perturbed(2), "3")
    assert [r.path for r in again] == ["replay"] * WORLD


def test_a_payload_that_fails_its_checksum_is_refused_and_nothing_is_loaded(group_of_two):
    group, receivers = group_of_two
    whole_push(group, receivers, pushed(), "1")
    before = [dict(r.loads.worker.model.state_dict()) for r in receivers]
    before = [{k: v.clone() for k, v in b.items()} for b in before]

    def bad_checksum(update):
        first = dataclasses.replace(update.workers[0], checksum=update.workers[0].checksum + 1)
        return dataclasses.replace(update, workers=(first, *update.workers[1:]))

    with pytest.raises(WeightSyncError, match="the slices worker 0 was sent of version 2"):
        per_worker_push(group, receivers, perturbed(1), "2", tamper=bad_checksum)
    for name, t in before[0].items():
        assert torch.equal(receivers[0].loads.worker.model.state_dict()[name], t), name


def test_a_payload_cut_by_runs_the_worker_does_not_hold_is_refused(group_of_two):
    group, receivers = group_of_two
    whole_push(group, receivers, pushed(), "1")

    def other_runs(update):
        wrong = dataclasses.replace(update.workers[1], runs_digest="0" * 32)
        return dataclasses.replace(update, workers=(update.workers[0], wrong))

    with pytest.raises(WeightSyncError, match="cut by runs it does not hold"):
        per_worker_push(group, receivers, perturbed(1), "2", tamper=other_runs)


def test_a_plan_that_no_longer_replays_reports_no_slices_and_fails_a_sliced_pause():
    loads = Loads(RankWorker(0))
    loads.load(pushed().items(), "1")
    model = loads.worker.model
    key = layout_of(list(pushed().items()))
    state = lambda: dict(model.named_parameters())  # noqa: E731
    assert loads.plans.slices(key, state) is not None
    model.o = torch.nn.Parameter(torch.zeros_like(model.o), requires_grad=False)
    assert loads.plans.slices(key, state) is None  # the next push goes whole

    from torchrl_vllm_ext.weight_sync.loading.loads import Received

    reads = loads.plans.reads(key)
    loads.stage("2", lambda: Received(list(perturbed(1).items()), reads=reads))
    with pytest.raises(WeightSyncError, match="received only its slices"):
        loads.load_staged("2")
    assert loads.intact()
