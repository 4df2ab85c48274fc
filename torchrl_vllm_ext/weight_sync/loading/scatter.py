"""A delta loaded in the pause by writing only what changed into the served parameters.

A delta update (:mod:`...delta`) brings a receiver's buffers from a base version to a new
one; when the served parameters hold that base exactly as a load plan wrote it
(:class:`.loads.Loads` knows), the pause need not replay the whole plan: each changed
position of a pushed tensor maps through the plan's :class:`~.plan.Copy` views to one
position of one served tensor. :func:`scatter` writes them with one batched mapping per
bucket (a few tensor ops over every changed position at once) and one ``index_put_`` per
served tensor written (torch has no scatter over many tensors); a copy that cannot be mapped
by an offset (strided views, a copy that overlaps another, a broadcast) is replayed whole
when its tensor changed, as are the tensors the delta sent whole. The result is bit for bit
that of a full replay of the new version (``tests/unit/test_scatter.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from torchrl_vllm_ext.weight_sync.loading.plan import BoundPlan, Copy, View


@dataclass(frozen=True)
class BucketChange:
    """What a delta changed of one bucket (its tensors packed end to end)."""

    names: tuple[str, ...]
    """The bucket's tensors, in order."""
    numels: tuple[int, ...]
    """Their elements."""
    positions: torch.Tensor
    """Elements changed one by one (ascending, positions in the bucket)."""
    values: torch.Tensor
    """Their new values, in the same order (1-D, the bucket's dtype)."""
    whole: frozenset[str] = frozenset()
    """Tensors the delta sent whole."""


@dataclass(frozen=True)
class Changes:
    """What a delta changed since ``base``: its buckets (unchanged buckets left out)."""

    base: str
    buckets: tuple[BucketChange, ...]


SCATTER_SHARE = 0.005
"""A tensor with more than this share of its elements changed is copied whole in the pause:
writing an element by position costs far more than copying one, and past about this
share the plan's replay of the whole tensor is faster (measured: ``benchmarks/README.md``,
``bench_delta.py --scatter-shares``)."""


@dataclass(frozen=True)
class _Offset:
    """A tensor's one offset copy: the elements of the tensor it reads (``lo`` to ``hi``),
    the offset to add to one (tensor position -> served position) and the served tensor."""

    lo: int
    hi: int
    shift: int
    target: torch.Tensor


@dataclass
class _Table:
    """One bucket layout mapped through one bound plan: each tensor's first element in the
    bucket (``starts``, and as a tensor for the search), elements, offset copy (None: not
    one) and copies (indices into the plan's: replayed whole when it is not scattered)."""

    starts: list[int]
    numels: tuple[int, ...]
    first: torch.Tensor
    offsets: list[_Offset | None]
    copies: list[list[int]]


@dataclass
class ScatterMap:
    """What :func:`scatter` derives once from a bound plan (kept on it)."""

    offset: list[bool]
    """Per copy: :func:`offset_copies`."""
    by_source: dict[str, list[int]]
    """Copies by pushed tensor."""
    tables: dict[tuple[str, ...], _Table] = field(default_factory=dict)
    """By bucket layout."""

    @classmethod
    def of(cls, bound: BoundPlan) -> ScatterMap:
        if bound.scatter_map is None:
            by_source: dict[str, list[int]] = {}
            for i, c in enumerate(bound.plan.copies):
                by_source.setdefault(c.source, []).append(i)
            bound.scatter_map = cls(offset_copies(bound), by_source)
        return bound.scatter_map


def contiguous(view: View) -> bool:
    """Whether ``view`` reads a run of consecutive elements in row-major order.

    Examples:
        >>> contiguous(View(4, (2, 3), (3, 1))), contiguous(View(0, (2, 2), (3, 1)))
        (True, False)
    """
    expected = 1
    for size, stride in reversed(list(zip(view.size, view.stride, strict=True))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def offset_copies(bound: BoundPlan) -> list[bool]:
    """Per copy of ``bound``: whether a position of its source maps to one of its target
    by an offset (both views contiguous runs of the same length, a contiguous target, no
    other copy writing any element of its run)."""
    copies = bound.plan.copies
    ok = [
        c.src.numel == c.dst.numel
        and contiguous(c.src)
        and contiguous(c.dst)
        and bound.tensors[c.target].is_contiguous()
        for c in copies
    ]
    by_target: dict[str, list[tuple[int, int, int]]] = {}
    for i, c in enumerate(copies):
        by_target.setdefault(c.target, []).append((c.dst.offset, c.dst.offset + c.dst.span(), i))
    for runs in by_target.values():
        runs.sort()
        for a, (_, stop, i) in enumerate(runs):
            for start, _, j in runs[a + 1 :]:
                if start >= stop:
                    break
                ok[i] = ok[j] = False  # they overlap: their order matters, replay both
    return ok


def _table(bound: BoundPlan, change: BucketChange) -> _Table:
    known = ScatterMap.of(bound)
    cached = known.tables.get(change.names)
    if cached is not None:
        return cached
    starts, offsets, copies, at = [], [], [], 0
    for name, numel in zip(change.names, change.numels, strict=True):
        mine = known.by_source.get(name, [])
        offset = None  # no copy (the loader's, skipped), or several, or one not an offset
        if len(mine) == 1 and known.offset[mine[0]]:
            one: Copy = bound.plan.copies[mine[0]]
            lo, flat = one.src.offset, bound.tensors[one.target].view(-1)
            offset = _Offset(lo, lo + one.src.numel, one.dst.offset - lo, flat)
        starts.append(at)
        offsets.append(offset)
        copies.append(mine)
        at += numel
    first = torch.tensor(starts, dtype=change.positions.dtype, device=change.positions.device)
    table = _Table(starts, change.numels, first, offsets, copies)
    known.tables[change.names] = table
    return table


def scatter(bound: BoundPlan, named: dict[str, torch.Tensor], changes: Changes) -> int:
    """Write what ``changes`` changed of the pushed tensors ``named`` (views of the new
    version) into the served tensors ``bound`` holds, which hold the base version as this
    plan wrote it; returns the elements written. The loader's own tensors are the caller's.
    """
    whole: set[int] = set()
    by_source = ScatterMap.of(bound).by_source
    written = 0
    for change in changes.buckets:
        for name in change.whole:
            whole.update(by_source.get(name, ()))
        if change.positions.numel():
            written += _scatter_bucket(bound, change, whole)
    if whole:
        order = sorted(whole)  # the plan's order: overlapping copies land as a replay's
        dsts = [bound.dsts[i] for i in order]
        srcs = [bound.plan.copies[i].src.on(named[bound.plan.copies[i].source]) for i in order]
        torch._foreach_copy_(dsts, srcs)
        written += sum(d.numel() for d in dsts)
    return written


def _scatter_bucket(bound: BoundPlan, change: BucketChange, whole: set[int]) -> int:
    """Write ``change``'s positions of its offset-mapped tensors into the served ones, one
    ``index_copy_`` per tensor (its positions are one run of the sorted positions: one
    search per tensor, none per position); the copies of the others, and of tensors
    changed past :data:`SCATTER_SHARE`, go whole (into ``whole``). Returns elements written."""
    table = _table(bound, change)
    positions = change.positions
    cuts = [*torch.searchsorted(positions, table.first).tolist(), positions.numel()]  # one sync
    written = 0
    for i, offset in enumerate(table.offsets):
        a, b = cuts[i], cuts[i + 1]
        if a == b:
            continue
        if offset is None or b - a > SCATTER_SHARE * table.numels[i]:
            whole.update(table.copies[i])
            continue
        start = table.starts[i]
        mine, values = positions[a:b], change.values[a:b]
        if offset.lo or offset.hi < table.numels[i]:  # the copy reads part of the tensor
            bounds = mine.new_tensor([start + offset.lo, start + offset.hi])
            lo, hi = torch.searchsorted(mine, bounds).tolist()
            mine, values = mine[lo:hi], values[lo:hi]
        target = offset.target
        index = mine.to(torch.int64).add_(offset.shift - start).to(target.device)
        target.index_copy_(0, index, values.to(target.device, target.dtype))
        written += index.numel()
    return written
