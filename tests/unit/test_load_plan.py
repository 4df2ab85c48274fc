"""The load plan's recorder and replay (weight_sync/loading/: recorder.py, plan.py, planned.py) on loaders
written as vLLM writes them: narrowed views, fused and sharded destinations, the vocab
padding; tainted tensors keep the loader; fingerprints invalidate; every push's own
buffers (storage slots A/B, broadcast receive buffers, IPC buckets) rebind the plan. The
criterion throughout: after a replayed push every parameter equals, bitwise, what the
model's own loader leaves."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from torchrl_vllm_ext.weight_sync.delta import apply_bucket, bucket_change, diff_and_sum
from torchrl_vllm_ext.weight_sync.loading import scatter as scatter_module
from torchrl_vllm_ext.weight_sync.loading.loads import Loads
from torchrl_vllm_ext.weight_sync.loading.plan import (
    BoundPlan,
    Copy,
    LoadPlan,
    View,
    content_sums,
    layout_of,
)
from torchrl_vllm_ext.weight_sync.loading.planned import PlannedLoader, model_state
from torchrl_vllm_ext.weight_sync.loading.recorder import trace
from torchrl_vllm_ext.weight_sync.loading.scatter import Changes, contiguous, offset_copies
from torchrl_vllm_ext.weight_sync.transports.packing import Packed, pack

H, FF, V, PAD = 8, 12, 10, 16  # hidden, intermediate, vocab, padded vocab


def _param(*shape, dtype=torch.float32) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


class TinyDecoder(nn.Module):
    """A vLLM-style model: fused qkv and gate_up, a padded vocab embedding, a transposed
    (Conv1D-style) projection, a norm; ``rank`` of ``world`` shards the column-parallel
    (qkv, gate_up) and row-parallel (down) weights as tensor parallelism does."""

    def __init__(self, rank: int = 0, world: int = 1, dtype=torch.float32):
        super().__init__()
        self.rank, self.world = rank, world
        self.qkv = _param(3 * H // world, H, dtype=dtype)
        self.gate_up = _param(2 * FF // world, H, dtype=dtype)
        self.down = _param(H, FF // world, dtype=dtype)
        self.embed = _param(PAD, H, dtype=dtype)
        self.proj = _param(H, H, dtype=dtype)  # stored [in, out] in the checkpoint
        self.norm = _param(H, dtype=dtype)
        self.register_buffer("rotary", torch.arange(4.0))  # never in a checkpoint

    def _shard(self, w: torch.Tensor, dim: int) -> torch.Tensor:
        size = w.shape[dim] // self.world
        return w.narrow(dim, self.rank * size, size)

    def load_weights(self, weights) -> None:
        stacked = {"q": ("qkv", 0), "k": ("qkv", 1), "v": ("qkv", 2), "gate": ("gate_up", 0)}
        stacked["up"] = ("gate_up", 1)
        for name, w in weights:
            if name in stacked:
                target, shard = stacked[name]
                param = getattr(self, target)
                rows = param.shape[0] // (3 if target == "qkv" else 2)
                param.data.narrow(0, shard * rows, rows).copy_(self._shard(w, 0))
            elif name == "down":
                self.down.data.copy_(self._shard(w, 1))
            elif name == "embed":
                self.embed[: w.shape[0]].data.copy_(w)
                self.embed[w.shape[0] :].data.fill_(0)
            elif name == "proj":
                self.proj.data.copy_(w.t())
            elif name == "norm":
                self.norm[:] = w  # a basic-index __setitem__
            elif name == "rotary.inv_freq":
                continue  # a computed buffer: skipped by name


def checkpoint(seed: int, dtype=torch.float32) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return [
        ("q", r(H, H)),
        ("k", r(H, H)),
        ("v", r(H, H)),
        ("gate", r(FF, H)),
        ("up", r(FF, H)),
        ("down", r(H, FF)),
        ("embed", r(V, H)),
        ("proj", r(H, H)),
        ("norm", r(H)),
        ("rotary.inv_freq", r(4)),
    ]


def loaded_by_loader(model: nn.Module, named) -> dict[str, torch.Tensor]:
    """What the model's own loader leaves, from a copy of ``model`` (the reference)."""
    ref = copy.deepcopy(model)
    ref.load_weights(iter(named))
    return {k: v.clone() for k, v in model_state(ref).items()}


def assert_bitwise(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for name, t in model_state(model).items():
        assert torch.equal(t.view(torch.uint8), expected[name].view(torch.uint8)), name


def plan_of(model, named):
    return trace(model.load_weights, named, model_state(model))


# ---------------------------------------------------------------------- views and layouts
def test_views_of_fused_destinations_replay_bitwise():
    model = TinyDecoder()
    plan = plan_of(model, checkpoint(0))
    assert plan.loader == {}
    assert plan.skipped == ("rotary.inv_freq",)
    by_source = {c.source: c for c in plan.copies}
    # q, k, v land in consecutive thirds of the fused qkv parameter
    assert [by_source[n].dst.offset for n in ("q", "k", "v")] == [0, H * H, 2 * H * H]
    assert by_source["proj"].src.stride == (1, H)  # the transposed view of the pushed tensor
    assert by_source["norm"].target == "norm"  # __setitem__ is a copy into the view
    # a later push replays into the same parameters, in place
    pointers = {n: t.data_ptr() for n, t in model_state(model).items()}
    named = checkpoint(1)
    expected = loaded_by_loader(model, named)
    plan.bind(model_state(model)).apply(dict(named))
    assert_bitwise(model, expected)
    assert pointers == {n: t.data_ptr() for n, t in model_state(model).items()}


def test_the_vocab_padding_is_written_once_and_kept():
    model = TinyDecoder()
    model.embed.data.fill_(5.0)
    plan = plan_of(model, checkpoint(0))  # the loader zeroes rows V: once
    assert model.embed[V:].abs().sum() == 0
    plan.bind(model_state(model)).apply(dict(checkpoint(2)))
    assert model.embed[V:].abs().sum() == 0
    assert torch.equal(model.embed[:V], dict(checkpoint(2))["embed"])


@pytest.mark.parametrize("world", [2, 4])
def test_each_tensor_parallel_rank_traces_its_own_shards(world):
    for rank in range(world):
        model = TinyDecoder(rank, world)
        plan = plan_of(model, checkpoint(0))
        down = next(c for c in plan.copies if c.source == "down")
        # row-parallel: this rank's columns of the pushed tensor
        assert down.src == View(rank * (FF // world), (H, FF // world), (FF, 1))
        named = checkpoint(3)
        expected = loaded_by_loader(model, named)
        plan.bind(model_state(model)).apply(dict(named))
        assert_bitwise(model, expected)


def test_a_bf16_model_loaded_from_fp32_casts_exactly_as_the_loader():
    model = TinyDecoder(dtype=torch.bfloat16)
    plan = plan_of(model, checkpoint(0))
    assert plan.loader == {}  # copy_ casts: no new tensor of the pushed one
    named = checkpoint(4)
    expected = loaded_by_loader(model, named)
    plan.bind(model_state(model)).apply(dict(named))
    assert_bitwise(model, expected)


def test_the_layout_key_holds_names_shapes_strides_dtypes_and_devices():
    a = checkpoint(0)
    b = [(n, t.t().contiguous().t() if t.ndim == 2 else t) for n, t in a]  # new strides
    assert layout_of(a) == layout_of(checkpoint(5))
    assert layout_of(a) != layout_of(b)
    assert layout_of(a) != layout_of([(n, t.double()) for n, t in a])


# ---------------------------------------------------------------------- taints
class Tainting(TinyDecoder):
    """One loader behaviour per name that a replay could not reproduce."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.scratch = torch.zeros(H, H)

    def load_weights(self, weights):
        rest = []
        for name, w in weights:
            if name != "proj":
                rest.append((name, w))
                continue
            how = self.how
            if how == "cast":
                self.proj.data.copy_(w.to(torch.float64))
            elif how == "contiguous":
                self.proj.data.copy_(w.t().contiguous())
            elif how == "cat":
                self.proj.data.copy_(torch.cat([w[: H // 2], w[H // 2 :]]))
            elif how == "math_on_param":
                self.proj.data.copy_(w)
                self.proj.data.mul_(2)
            elif how == "math_reads_back":
                self.proj.data.copy_(w)
                self.norm.data.copy_(self.proj.sum(0))
            elif how == "rebind":
                self.proj.data = w  # the parameter aliases the pushed buffer
            elif how == "value_branch":
                self.proj.data.copy_(w if bool((w > 100).any()) else -w)
            elif how == "item":
                self.proj.data.fill_(w[0, 0].item())
            elif how == "scratch":
                self.scratch.copy_(w)
                self.proj.data.copy_(self.scratch)
            elif how == "advanced_index":
                self.proj.data[torch.tensor([0, 1])] = w[:2]
                self.proj.data[2:].copy_(w[2:])
            elif how == "write_into_pushed":
                w.mul_(1.0)
                self.proj.data.copy_(w)
        super().load_weights(rest)


TAINTS = {
    "cast": "computes a new tensor",
    "contiguous": "computes a new tensor",
    "cat": "computes a new tensor",
    "math_on_param": "the loader",
    "math_reads_back": "reads proj back",
    "rebind": "rebinds proj to it",
    "value_branch": "",
    "item": "reads its values",
    "scratch": "not the model's",
    "advanced_index": "advanced index",
    "write_into_pushed": "writes into it",
}


@pytest.mark.parametrize("how", list(TAINTS))
def test_a_tainted_tensor_keeps_the_loader_and_the_others_replay(how):
    model = Tainting(how)
    plan = plan_of(model, checkpoint(0))
    # reading proj back computes norm from it, written before norm's own copy: the
    # loader, run again for proj after a replay, would overwrite norm: both keep it
    kept = {"proj", "norm"} if how == "math_reads_back" else {"proj"}
    assert set(plan.loader) == kept, plan.loader
    assert TAINTS[how] in plan.loader["proj"]
    assert {c.source for c in plan.copies} == {n for n, _ in checkpoint(0)} - kept - {
        "rotary.inv_freq"
    }
    # the planned loader replays the rest and runs the model's loader for proj alone
    loader = PlannedLoader()
    state = lambda: model_state(model)  # noqa: E731
    assert loader.load(model.load_weights, state, checkpoint(0)).path == "trace"
    named = checkpoint(6)
    expected = loaded_by_loader(model, named)
    report = loader.load(model.load_weights, state, named)
    assert report.path in ("replay", "trace")  # a rebinding loader is traced again
    assert report.path == "trace" or "proj" in report.why
    assert_bitwise(model, expected)


class Overlapping(TinyDecoder):
    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def load_weights(self, weights):
        named = dict(weights)
        super().load_weights(iter(named.items()))
        if self.how == "two_copies":  # q written again over k's rows
            self.qkv.data[H // 2 : H + H // 2].copy_(named["q"])
        elif self.how == "constant_after":  # a constant over gate's rows, after gate
            self.gate_up.data[:2].fill_(0.5)


@pytest.mark.parametrize(
    ("how", "tainted"), [("two_copies", {"q", "k"}), ("constant_after", {"gate"})]
)
def test_overlapping_destinations_keep_the_loader(how, tainted):
    model = Overlapping(how)
    plan = plan_of(model, checkpoint(0))
    assert set(plan.loader) == tainted
    named = checkpoint(7)
    expected = loaded_by_loader(model, named)
    loader = PlannedLoader()
    state = lambda: model_state(model)  # noqa: E731
    loader.load(model.load_weights, state, checkpoint(0))
    assert loader.load(model.load_weights, state, named).path == "replay"
    assert_bitwise(model, expected)


def test_interleaved_destinations_are_disjoint_exactly():
    """Two views whose byte ranges overlap but whose elements do not (every other column)
    both replay."""

    class Interleaved(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = _param(4, 6)

        def load_weights(self, weights):
            for name, t in weights:
                self.w.data[:, 0 if name == "even" else 1 :: 2].copy_(t)

    model = Interleaved()
    named = [("even", torch.ones(4, 3)), ("odd", torch.full((4, 3), 2.0))]
    plan = plan_of(model, named)
    assert plan.loader == {} and len(plan.copies) == 2


# ---------------------------------------------------------------------- the planned loader
def test_the_trace_push_loads_like_the_loader_then_replays():
    model = TinyDecoder()
    loader = PlannedLoader()
    state = lambda: model_state(model)  # noqa: E731
    for seed, path in [(0, "trace"), (1, "replay"), (2, "replay")]:
        named = checkpoint(seed)
        expected = loaded_by_loader(model, named)
        report = loader.load(model.load_weights, state, named)
        assert report.path == path
        assert_bitwise(model, expected)
    assert report.replayed_bytes == sum(
        t.numel() * 4 for n, t in checkpoint(0) if n != "rotary.inv_freq"
    )


def test_a_moved_parameter_is_traced_again():
    model = TinyDecoder()
    loader = PlannedLoader()
    state = lambda: model_state(model)  # noqa: E731
    loader.load(model.load_weights, state, checkpoint(0))
    plan = loader.plan(checkpoint(0))
    model.qkv.data = torch.zeros_like(model.qkv)  # a new pointer (vLLM reallocated it)
    assert plan.bind(model_state(model)) is None
    named = checkpoint(1)
    expected = loaded_by_loader(model, named)
    assert loader.load(model.load_weights, state, named).path == "trace"
    assert_bitwise(model, expected)
    assert loader.load(model.load_weights, state, checkpoint(2)).path == "replay"


def test_a_replay_that_differs_from_the_loader_is_refused_for_good():
    """What the recorder cannot see (work with torch functions disabled) is caught by the
    trace push's comparison: the loader loads again and keeps the layout."""

    class Hidden(TinyDecoder):
        def load_weights(self, weights):
            super().load_weights(weights)
            with torch._C.DisableTorchFunction():
                self.norm.data.mul_(2)

    model = Hidden()
    loader = PlannedLoader()
    state = lambda: model_state(model)  # noqa: E731
    for seed in (0, 1):
        named = checkpoint(seed)
        expected = loaded_by_loader(model, named)
        report = loader.load(model.load_weights, state, named)
        assert report.path == "loader" and "differently" in report.why
        assert_bitwise(model, expected)


def test_no_memory_for_the_trace_push_check_loads_with_the_loader_and_traces_again(
    monkeypatch,
):
    """A colocated trainer may leave no GPU memory for the check's scratch: the push still
    loads (no partial load, no restart), and the next one traces."""
    from torchrl_vllm_ext.weight_sync.loading import planned as planned_load

    model = TinyDecoder()
    loader = PlannedLoader()
    state = lambda: model_state(model)  # noqa: E731
    real = planned_load.content_sums
    calls = []

    def short_of_memory(tensors):
        calls.append(1)
        if len(calls) == 2:  # after the replay
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return real(tensors)

    monkeypatch.setattr(planned_load, "content_sums", short_of_memory)
    named = checkpoint(0)
    expected = loaded_by_loader(model, named)
    report = loader.load(model.load_weights, state, named)
    assert report.path == "loader" and "no GPU memory" in report.why
    assert_bitwise(model, expected)
    assert loader.plan(named) is None
    named = checkpoint(1)
    expected = loaded_by_loader(model, named)
    assert loader.load(model.load_weights, state, named).path == "trace"
    assert_bitwise(model, expected)


def test_plans_off_load_every_push_with_the_loader():
    model = TinyDecoder()
    loader = PlannedLoader()
    loader.enabled = False
    report = loader.load(model.load_weights, lambda: model_state(model), checkpoint(0))
    assert report.path == "loader" and "off" in report.why
    assert loader.plan(checkpoint(0)) is None


def test_old_layouts_are_dropped_past_keep():
    model = TinyDecoder()
    loader = PlannedLoader(keep=2)
    state = lambda: model_state(model)  # noqa: E731
    layouts = [checkpoint(0), checkpoint(0, torch.bfloat16), checkpoint(0, torch.float64)]
    for named in layouts:
        assert loader.load(model.load_weights, state, named).path == "trace"
    assert loader.plan(layouts[0]) is None and loader.plan(layouts[2]) is not None


# ---------------------------------------------------------------------- rebinding
def _slot(named, seed: int) -> dict[str, torch.Tensor]:
    """A storage slot: its own buffers, written in place by each push."""
    return {n: torch.empty_like(t) for n, t in named}


def test_rebinding_to_storage_slots_a_and_b():
    model = TinyDecoder()
    loader = PlannedLoader()
    state = lambda: model_state(model)  # noqa: E731
    slots = {"A": _slot(checkpoint(0), 0), "B": _slot(checkpoint(0), 1)}
    for push in range(5):
        slot = slots["AB"[push % 2]]
        for n, t in checkpoint(10 + push):
            slot[n].copy_(t)
        named = list(slot.items())
        expected = loaded_by_loader(model, named)
        assert loader.load(model.load_weights, state, named).path == (
            "trace" if push == 0 else "replay"
        )
        assert_bitwise(model, expected)


def test_rebinding_to_new_receive_buffers_every_push():
    model = TinyDecoder()
    loader = PlannedLoader()
    state = lambda: model_state(model)  # noqa: E731
    for push in range(3):
        named = [(n, t.clone()) for n, t in checkpoint(20 + push)]  # fresh memory
        expected = loaded_by_loader(model, named)
        loader.load(model.load_weights, state, named)
        assert_bitwise(model, expected)


def test_rebinding_to_packed_buckets_views_of_one_storage():
    """IPC / broadcast buckets: every tensor a view into a few shared uint8 buffers, new
    buffers each push; the source views are found by byte range within the bucket."""
    model = TinyDecoder()
    loader = PlannedLoader()
    state = lambda: model_state(model)  # noqa: E731
    for push in range(3):
        packed = pack(dict(checkpoint(30 + push)), str(push), bucket_bytes=1024)
        assert len(packed.buffers) > 1
        named = list(packed.tensors().items())
        expected = loaded_by_loader(model, named)
        assert loader.load(model.load_weights, state, named).path == (
            "trace" if push == 0 else "replay"
        )
        assert_bitwise(model, expected)


def test_a_view_spanning_two_packed_tensors_keeps_the_loader():
    class Spanning(TinyDecoder):
        def load_weights(self, weights):
            named = list(weights)
            q = dict(named)["q"]
            # reads past q's end into k's bytes (a wrong loader, but one to survive)
            wide = q.as_strided((H + 1, H), (H, 1))
            self.qkv.data[: H + 1].copy_(wide)
            super().load_weights(iter([(n, t) for n, t in named if n != "q"]))

    model = Spanning()
    packed = pack(dict(checkpoint(0)), "0")
    plan = plan_of(model, list(packed.tensors().items()))
    assert "q" in plan.loader


# ---------------------------------------------------------------------- delta scatter
def moved(named, seed: int, whole: str = "norm", still: str = "gate"):
    """The next version of ``named``: a few values of each tensor changed, ``whole``
    changed everywhere, ``still`` not at all."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, t in named:
        t = t.clone()
        flat = t.view(-1)
        if name == whole:
            flat += 1.0
        elif name != still:
            at = torch.randint(0, flat.numel(), (3,), generator=g)
            flat[at] += 1.0
        out.append((name, t))
    return out


def delta_into(held: Packed, new: Packed) -> Changes:
    """What a broadcast receiver does with a delta of ``new`` against the buckets it
    ``held`` (written into them): the changes handed to the pause."""
    changed = []
    for bucket, old, now in zip(new.header.buckets, held.buffers, new.buffers, strict=True):
        delta, payload, _ = diff_and_sum(now, old, bucket, dense_share=0.5)
        if payload.numel():
            positions, values = apply_bucket(old, bucket, delta, payload)
            changed.append(bucket_change(bucket, delta, positions, values))
    assert [torch.equal(a, b) for a, b in zip(held.buffers, new.buffers, strict=True)]
    return Changes(held.version, tuple(changed))


SCATTERED = {
    "fused": lambda: TinyDecoder(),
    "tensor parallel": lambda: TinyDecoder(1, 2),  # down: strided columns, replayed whole
    "bf16 from fp32": lambda: TinyDecoder(dtype=torch.bfloat16),
    "loader keeps proj": lambda: Tainting("cast"),
    "overlapping copies": lambda: Overlapping("two_copies"),
}


@pytest.mark.parametrize("make", list(SCATTERED))
def test_a_delta_scattered_into_the_served_tensors_equals_a_full_load(make, monkeypatch):
    # every changed value written by position (these tensors are tiny: 3 of 64 changed)
    monkeypatch.setattr(scatter_module, "SCATTER_SHARE", 1.0)
    model = SCATTERED[make]()
    loader = PlannedLoader()
    state = lambda: model_state(model)  # noqa: E731
    named = checkpoint(40)
    held = pack(dict(named), "1", bucket_bytes=1024)  # the receiver's buffers
    assert loader.load(model.load_weights, state, list(held.tensors().items())).path == "trace"
    for version in (2, 3):
        named = moved(named, seed=version)
        changes = delta_into(held, pack(dict(named), str(version), bucket_bytes=1024))
        expected = loaded_by_loader(model, named)
        report = loader.scatter(model.load_weights, state, list(held.tensors().items()), changes)
        assert report.path == "scatter"
        assert report.replayed_bytes < report.nbytes // 2, report
        assert_bitwise(model, expected)
        held = Packed(dataclasses.replace(held.header, version=str(version)), held.buffers)


def test_a_delta_after_the_loaders_load_or_of_another_layout_loads_whole():
    model = TinyDecoder()
    loader = PlannedLoader()
    state = lambda: model_state(model)  # noqa: E731
    held = pack(dict(checkpoint(41)), "1", bucket_bytes=1024)
    named = list(held.tensors().items())
    loader.load(model.load_weights, state, named)
    changes = delta_into(held, pack(dict(moved(checkpoint(41), 2)), "2", bucket_bytes=1024))
    loader.enabled = False
    assert loader.load(model.load_weights, state, named).path == "loader"
    loader.enabled = True
    assert loader.scatter(model.load_weights, state, named, changes) is None
    assert loader.load(model.load_weights, state, named).path == "replay"
    other = pack(dict(checkpoint(41)), "x", dtype=torch.bfloat16)  # another layout
    assert loader.scatter(model.load_weights, state, list(other.tensors().items()), changes) is None
    assert loader.scatter(model.load_weights, state, named, changes) is None  # once only


def test_the_worker_scatters_only_a_delta_of_the_version_its_parameters_hold():
    model = TinyDecoder()
    loads = Loads(SimpleNamespace(get_model=lambda: model))
    named = checkpoint(42)
    held = pack(dict(named), "1", bucket_bytes=1024)
    assert loads.load(list(held.tensors().items()), "1").path == "trace"
    named = moved(named, 2)
    changes = delta_into(held, pack(dict(named), "2", bucket_bytes=1024))
    assert loads.load(list(held.tensors().items()), "2", changes=changes).path == "scatter"
    assert_bitwise(model, loaded_by_loader(model, named))
    named = moved(named, 3)
    changes = delta_into(held, pack(dict(named), "3", bucket_bytes=1024))
    stale = dataclasses.replace(changes, base="0")  # not what the parameters hold
    assert loads.load(list(held.tensors().items()), "3", changes=stale).path == "replay"
    assert loads.forget_served()  # vLLM's level-2 sleep
    assert loads.load(list(held.tensors().items()), "3", changes=changes).path == "replay"
    assert_bitwise(model, loaded_by_loader(model, named))


def test_copies_that_overlap_or_are_not_runs_are_not_offsets():
    model = TinyDecoder(1, 2)
    plan = plan_of(model, checkpoint(0))
    offsets = dict(
        zip(
            [c.source for c in plan.copies],
            offset_copies(plan.bind(model_state(model))),
            strict=True,
        )
    )
    assert offsets["q"] and offsets["gate"]  # rows of a fused parameter
    assert not offsets["down"] and not offsets["proj"]  # columns; a transpose
    assert contiguous(View(0, (1, 4), (99, 1))) and not contiguous(View(0, (2, 2), (1, 2)))


# ---------------------------------------------------------------------- checksums
def test_content_sums_see_positions():
    a = torch.arange(16.0).view(4, 4)
    assert content_sums([a])[0] != content_sums([a.flip(0).contiguous()])[0]
    assert content_sums([a, a]) == [content_sums([a])[0]] * 2
    odd = torch.arange(3, dtype=torch.uint8)  # not a whole number of words
    assert content_sums([odd])[0] != content_sums([odd.flip(0)])[0]


def test_every_copy_overlapping_another_is_replayed_whole():
    """Runs [0, 6), [6, 30) and [4, 5) of one target (a plan the trace would not keep: its
    overlaps go to the loader; the scatter checks again): the last overlaps the first only."""
    w = torch.zeros(30)
    runs = {"y": (0, 6), "z": (6, 24), "x": (4, 1)}
    copies = tuple(
        Copy(name, View(0, (n,), (1,)), "w", View(at, (n,), (1,))) for name, (at, n) in runs.items()
    )
    bound = BoundPlan(LoadPlan((), copies), {"w": w}, [])
    assert offset_copies(bound) == [False, True, False]
