"""Each worker's slice of each pushed tensor, read off its traced load plan: loaders shaped
as vLLM's tensor- and expert-parallel ones (column / row shards, fused QKV, a padded vocab,
replicated norms, experts owned per rank) on two ranks. Sharded tensors are covered
exactly once by the ranks together; replicated ones whole by each; a tensor the loader
computes from is kept whole; one the model does not hold by nobody."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchrl_vllm_ext.weight_sync.loading.loads import Loads, Received
from torchrl_vllm_ext.weight_sync.loading.plan import layout_of
from torchrl_vllm_ext.weight_sync.loading.recorder import trace
from torchrl_vllm_ext.weight_sync.loading.slices import (
    TensorSlice,
    kept_bytes,
    plan_slices,
    slice_reads,
)

WORLD = 2
HIDDEN, HEADS_DIM, VOCAB, EXPERTS = 8, 4, 11, 4  # an odd vocab: the last rank is padded


def pushed() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "embed": (VOCAB, HIDDEN),
        "q": (HIDDEN, HIDDEN),
        "k": (HEADS_DIM, HIDDEN),
        "v": (HEADS_DIM, HIDDEN),
        "o": (HIDDEN, HIDDEN),
        "norm": (HIDDEN,),
        "scale": (HIDDEN,),
        "unused": (3,),  # a checkpoint tensor no parameter holds
        **{f"experts.{e}.w": (HIDDEN, HIDDEN) for e in range(EXPERTS)},
    }
    return {n: torch.randn(s, generator=gen) for n, s in shapes.items()}


class ShardedModel(torch.nn.Module):
    """Rank ``rank`` of ``WORLD``: what vLLM's parallel layers hold and how they load."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank
        rows = -(-VOCAB // WORLD)  # padded vocab rows per rank
        p = lambda *shape: torch.nn.Parameter(torch.zeros(shape), requires_grad=False)  # noqa: E731
        self.embed = p(rows, HIDDEN)
        self.qkv = p((HIDDEN + 2 * HEADS_DIM) // WORLD, HIDDEN)  # column parallel, fused
        self.o = p(HIDDEN, HIDDEN // WORLD)  # row parallel: a column block of the input
        self.norm = p(HIDDEN)  # replicated
        self.scale = p(HIDDEN)  # the loader computes from it: kept whole
        self.experts = p(EXPERTS // WORLD, HIDDEN, HIDDEN)  # expert parallel

    def load_weights(self, weights):
        r = self.rank
        for name, w in weights:
            if name == "embed":
                rows = -(-VOCAB // WORLD)
                part = w[r * rows : min((r + 1) * rows, VOCAB)]
                self.embed.data[: part.shape[0]].copy_(part)
            elif name in ("q", "k", "v"):
                sizes = {"q": HIDDEN, "k": HEADS_DIM, "v": HEADS_DIM}
                start = {"q": 0, "k": HIDDEN, "v": HIDDEN + HEADS_DIM}[name] // WORLD
                n = sizes[name] // WORLD
                self.qkv.data[start : start + n].copy_(w.narrow(0, r * n, n))
            elif name == "o":
                n = HIDDEN // WORLD
                self.o.data.copy_(w.narrow(1, r * n, n))
            elif name == "norm":
                self.norm.data.copy_(w)
            elif name == "scale":
                self.scale.data.copy_(w * 2.0)  # math on the pushed tensor
            elif name.startswith("experts."):
                e = int(name.split(".")[1])
                owned = EXPERTS // WORLD
                if e // owned == r:
                    self.experts.data[e % owned].copy_(w)


def plans():
    named = list(pushed().items())
    out = []
    for rank in range(WORLD):
        model = ShardedModel(rank)
        out.append(trace(model.load_weights, named, dict(model.named_parameters())))
    return out


def coverage(slices: list[TensorSlice]) -> np.ndarray:
    counts = np.zeros(slices[0].numel, dtype=np.int64)
    for s in slices:
        for start, stop in s.runs:
            counts[start:stop] += 1
    return counts


def test_sharded_tensors_are_covered_once_by_the_ranks():
    per_rank = [plan_slices(p) for p in plans()]
    for name in ["embed", "q", "k", "v", "o", *(f"experts.{e}.w" for e in range(EXPERTS))]:
        counts = coverage([s[name] for s in per_rank])
        assert (counts == 1).all(), (name, counts)
    for name in ["embed", "q", "k", "v", "o"]:  # tensor parallel: a part on every rank
        assert all(0 < s[name].kept < s[name].numel for s in per_rank), name
    # a row-parallel layer's input columns: one run per row on each rank
    assert len(per_rank[0]["o"].runs) == HIDDEN
    # experts: each rank keeps the ones it owns whole, the others not at all
    assert [per_rank[0][f"experts.{e}.w"].kept for e in range(EXPERTS)] == [64, 64, 0, 0]


@pytest.mark.parametrize("name", ["norm", "scale"])
def test_replicated_and_computed_tensors_are_kept_whole_by_every_rank(name):
    for plan in plans():
        assert plan_slices(plan)[name].whole, name
    assert "scale" in plans()[0].loader  # computed: the loader keeps it


def test_kept_bytes_is_what_the_slices_hold():
    tensors = pushed()
    total = sum(t.numel() * t.element_size() for n, t in tensors.items() if n != "unused")
    replicated = sum(tensors[n].numel() * 4 for n in ("norm", "scale"))
    kept = [kept_bytes(p) for p in plans()]
    assert sum(kept) == total + replicated  # sharded bytes once, replicated ones per rank
    assert all(k < total for k in kept)


def test_a_tensor_the_model_does_not_hold_is_kept_by_no_rank():
    for plan in plans():
        assert plan.layout == layout_of(list(pushed().items()))
        slices = plan_slices(plan)
        assert set(slices) == set(pushed())
        assert slices["unused"].kept == 0 and slices["unused"].runs == ()


# ---------------------------------------------------------------- slice reads (storage)


class Worker:
    """What :class:`Loads` asks of vLLM's worker: its model."""

    def __init__(self, model):
        self.model = model

    def get_model(self):
        return self.model


def perturbed(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=gen) for n, t in pushed().items()}


def stage_and_load(rank: int, sliced: bool, move: bool = False):
    """A worker of rank ``rank`` traces the first push, then stages the second (its slices
    only, or whole) and loads it in its pause; ``move``: a parameter moves in between."""
    loads = Loads(Worker(ShardedModel(rank)))
    slot = pushed()
    loads.load(slot.items(), "1")  # the trace
    slot = perturbed(1)
    key = layout_of(list(slot.items()))
    reads = loads.plans.reads(key) if sliced else None
    staged = loads.copy_in(
        slot, torch.device("cpu"), "device", None if reads is None else reads.views
    )
    if move:
        loads.worker.model.o = torch.nn.Parameter(torch.zeros_like(loads.worker.model.o))
    loads.stage(
        "2", lambda: Received(staged, reads=reads, whole=list(slot.items()) if reads else None)
    )
    report = loads.load_staged("2")
    return loads.worker.model, report, reads


@pytest.mark.parametrize("rank", range(WORLD))
def test_a_worker_reads_its_slices_and_the_rest_whole_with_the_reason(rank):
    reads = slice_reads(plans()[rank])
    assert set(reads.views) == {
        *(f"experts.{e}.w" for e in range(EXPERTS) if e // (EXPERTS // WORLD) != rank),
        "embed",
        "q",
        "k",
        "v",
        "o",
        "unused",
    }
    owned = {f"experts.{e}.w" for e in range(EXPERTS) if e // (EXPERTS // WORLD) == rank}
    assert set(reads.whole) == {"norm", "scale", *owned}
    assert reads.whole["norm"].startswith("this worker keeps every element")
    assert reads.whole["scale"].startswith("the loader computes from it")
    assert reads.views["unused"] == ()  # read by nobody
    tensors = pushed()
    sharded = sum(tensors[n].numel() * 4 for n in reads.views)
    assert reads.sliced_received == reads.sliced_kept < sharded  # 1.0: no element read twice
    assert reads.received_bytes == reads.kept_bytes == kept_bytes(plans()[rank])


@pytest.mark.parametrize("rank", range(WORLD))
def test_a_sliced_staging_loads_bitwise_what_a_whole_staging_loads(rank):
    whole_model, whole_report, _ = stage_and_load(rank, sliced=False)
    sliced_model, report, reads = stage_and_load(rank, sliced=True)
    for (name, a), (_, b) in zip(
        whole_model.state_dict().items(), sliced_model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert whole_report.received_bytes is None and whole_report.path == report.path == "replay"
    assert report.received_bytes == reads.received_bytes < report.nbytes
    assert report.sliced_received_bytes == report.sliced_kept_bytes
    assert {"norm", "scale"} <= set(report.whole) and report.whole == reads.whole


def test_a_plan_that_no_longer_replays_at_the_pause_loads_the_whole_tensors():
    model, report, reads = stage_and_load(0, sliced=True, move=True)
    expected = ShardedModel(0)
    expected.load_weights(perturbed(1).items())
    for (name, a), (_, b) in zip(
        expected.state_dict().items(), model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert report.path == "trace"  # the moved parameter: traced again, from the whole tensors
    assert report.received_bytes == report.nbytes + reads.received_bytes
