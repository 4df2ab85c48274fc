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
    values: torch.Tensor
    """The bucket's elements after the delta (1-D, its dtype: a view of the buffer)."""
    positions: torch.Tensor
    """Elements changed one by one (ascending, positions in the bucket)."""
    whole: frozenset[str] = frozenset()
    """Tensors the delta sent whole."""


@dataclass(frozen=True)
class Changes:
    """What a delta changed since ``base``: its buckets (unchanged buckets left out)."""

    base: str
    buckets: tuple[BucketChange, ...]


@dataclass
class _Table:
    """One bucket layout mapped through one bound plan, per tensor of the bucket: the bucket
    positions its one offset copy reads (``lo`` to ``hi``; empty: not mapped),
    the offset to add (``shift``: bucket position -> served position) and the served
    tensor's index (``target``)."""

    ends: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    shift: torch.Tensor
    target: torch.Tensor
    unmapped: list[list[int] | None]
    """Each tensor's copies (indices into the plan's) when it is not mapped: replayed whole
    when it changed."""


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
        reach, last = -1, -1
        for start, stop, i in runs:
            if start < reach:  # overlaps an earlier run: their order matters, replay both
                ok[i] = ok[last] = False
            if stop > reach:
                reach, last = stop, i
    return ok


def _table(bound: BoundPlan, names: tuple[str, ...], numels: tuple[int, ...]) -> _Table:
    known = ScatterMap.of(bound)
    cached = known.tables.get(names)
    if cached is not None:
        return cached
    targets = {name: i for i, name in enumerate(bound.tensors)}
    rows, unmapped, at = [], [], 0
    for name, numel in zip(names, numels, strict=True):
        mine = known.by_source.get(name, [])
        if len(mine) == 1 and known.offset[mine[0]]:
            one: Copy = bound.plan.copies[mine[0]]
            lo = at + one.src.offset
            rows.append((lo, lo + one.src.numel, one.dst.offset - lo, targets[one.target]))
            unmapped.append(None)
        else:  # no copy (the loader's, skipped), or several, or one not an offset
            rows.append((0, 0, 0, -1))
            unmapped.append(mine)
        at += numel
    device = next(iter(bound.tensors.values())).device
    ints = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4).to(device)
    table = _Table(
        ends=torch.tensor(numels, dtype=torch.int64).cumsum(0).to(device),
        lo=ints[:, 0],
        hi=ints[:, 1],
        shift=ints[:, 2],
        target=ints[:, 3],
        unmapped=unmapped,
    )
    known.tables[names] = table
    return table


def scatter(bound: BoundPlan, named: dict[str, torch.Tensor], changes: Changes) -> int:
    """Write what ``changes`` changed of the pushed tensors ``named`` (views of the new
    version) into the served tensors ``bound`` holds, which hold the base version as this
    plan wrote it; returns the elements written. The loader's own tensors are the caller's.
    """
    whole: set[int] = set()
    by_source = ScatterMap.of(bound).by_source
    found: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for change in changes.buckets:
        for name in change.whole:
            whole.update(by_source.get(name, ()))
        if change.positions.numel():
            _map_bucket(bound, change, whole, found)
    written = 0
    if whole:
        order = sorted(whole)  # the plan's order: overlapping copies land as a replay's
        dsts = [bound.dsts[i] for i in order]
        srcs = [bound.plan.copies[i].src.on(named[bound.plan.copies[i].source]) for i in order]
        torch._foreach_copy_(dsts, srcs)
        written += sum(d.numel() for d in dsts)
    served = list(bound.tensors.values())
    for t, parts in found.items():
        flat = served[t].view(-1)
        index = torch.cat([p[0] for p in parts]).to(flat.device)
        values = torch.cat([p[1] for p in parts]).to(flat.device, flat.dtype)
        flat.index_put_((index,), values)
        written += index.numel()
    return written


def _map_bucket(bound: BoundPlan, change: BucketChange, whole: set[int], found: dict) -> None:
    """The served positions and values of ``change``'s positions, by served tensor (into
    ``found``); the copies of tensors that cannot be mapped go whole (into ``whole``)."""
    table = _table(bound, change.names, change.numels)
    positions = change.positions.to(device=table.ends.device, dtype=torch.int64)
    owner = torch.searchsorted(table.ends, positions, right=True)
    counts = torch.bincount(owner, minlength=len(change.names)).tolist()
    for n, copies in zip(counts, table.unmapped, strict=True):
        if n and copies:
            whole.update(copies)
    keep = (positions >= table.lo[owner]) & (positions < table.hi[owner])
    owner, positions = owner[keep], positions[keep]
    target = table.target[owner]
    index = positions + table.shift[owner]
    values = change.values[positions.to(change.values.device)]
    order = torch.argsort(target, stable=True)
    per_target = torch.bincount(target, minlength=len(bound.tensors)).tolist()
    pieces = zip(index[order].split(per_target), values[order].split(per_target), strict=True)
    for t, (i, v) in enumerate(pieces):
        if per_target[t]:
            found.setdefault(t, []).append((i, v))
