"""Which elements of each pushed tensor one worker keeps: read off its load plan.

A plan's copies say which view of each pushed tensor the worker's loader read (a
tensor-parallel rank's rows or columns, a fused piece, the experts it owns); the union of
those views is the worker's slice of that tensor. A tensor the loader keeps (it computes
from it) is kept whole; one it skipped, not at all. Slices are element runs
``[start, stop)`` of the tensor, flattened in its pushed (contiguous) layout, merged and
sorted: what a push would have to send that worker, and what it receives beyond that
today (every worker gets every tensor whole).

:func:`slice_reads` says what a worker reads of each tensor of a layout (a storage worker
copies only those views out of the slot: :mod:`...transports.storage.receiver`): the
views its plan's copies read, or the whole tensor, with the reason, where the plan cannot
slice it (the loader computes from it) or there is nothing to cut (every element kept:
replicated, or an expert the worker owns).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from torchrl_vllm_ext.weight_sync.loading.plan import LoadPlan, View


@dataclass(frozen=True)
class TensorSlice:
    """The elements of one pushed tensor a worker keeps.

    Examples:
        >>> s = TensorSlice.of(numel=8, runs=[(4, 6), (0, 2), (1, 3)])
        >>> s.runs, s.kept, s.whole
        (((0, 3), (4, 6)), 5, False)
    """

    numel: int
    """Elements of the pushed tensor."""
    runs: tuple[tuple[int, int], ...]
    """Merged, sorted ``[start, stop)`` element runs kept."""

    @classmethod
    def of(cls, numel: int, runs) -> TensorSlice:
        return cls(numel, tuple(merge_runs(np.asarray(list(runs), dtype=np.int64).reshape(-1, 2))))

    @property
    def kept(self) -> int:
        """Elements kept."""
        return sum(stop - start for start, stop in self.runs)

    @property
    def whole(self) -> bool:
        return self.runs == ((0, self.numel),)


def view_runs(view: View) -> np.ndarray:
    """The ``[start, stop)`` element runs a strided view touches, relative to its base
    (trailing dimensions that lie contiguously folded into one run).

    Examples:
        >>> import torch
        >>> base = torch.arange(12.0).view(3, 4)
        >>> view_runs(View.of(base[:, 1:3], base)).tolist()  # a column block
        [[1, 3], [5, 7], [9, 11]]
        >>> view_runs(View.of(base[1:], base)).tolist()  # a row block: one run
        [[4, 12]]
    """
    if view.numel == 0:
        return np.zeros((0, 2), dtype=np.int64)
    if view.span() == view.numel:  # a dense block, in any order of its dimensions
        return np.array([[view.offset, view.offset + view.numel]], dtype=np.int64)
    dims = [
        (size, stride) for size, stride in zip(view.size, view.stride, strict=True) if size != 1
    ]
    run = 1  # elements of one contiguous run at the innermost dimensions
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    starts = np.array([view.offset], dtype=np.int64)
    for size, stride in dims:
        starts = (starts[:, None] + np.arange(size, dtype=np.int64) * stride).reshape(-1)
    return np.stack([starts, starts + run], axis=1)


def merge_runs(runs: np.ndarray) -> list[tuple[int, int]]:
    """Overlapping or touching runs merged, sorted by start.

    >>> merge_runs(np.array([[5, 7], [0, 2], [2, 3], [6, 9]]))
    [(0, 3), (5, 9)]
    """
    if len(runs) == 0:
        return []
    runs = runs[np.argsort(runs[:, 0], kind="stable")]
    starts, stops = runs[:, 0], np.maximum.accumulate(runs[:, 1])
    new = np.ones(len(runs), dtype=bool)
    new[1:] = starts[1:] > stops[:-1]
    firsts = np.flatnonzero(new)
    ends = np.append(firsts[1:] - 1, len(runs) - 1)
    return [(int(starts[a]), int(stops[b])) for a, b in zip(firsts, ends, strict=True)]


def plan_slices(plan: LoadPlan) -> dict[str, TensorSlice]:
    """Each pushed tensor of ``plan``'s layout: the slice this worker keeps."""
    views: dict[str, list[np.ndarray]] = {}
    for copy in plan.copies:
        views.setdefault(copy.source, []).append(view_runs(copy.src))
    slices = {}
    for name, shape, *_ in plan.layout:
        numel = math.prod(shape)
        if name in plan.loader:  # the loader reads all of it
            slices[name] = TensorSlice(numel, ((0, numel),) if numel else ())
        else:
            runs = views.get(name)
            slices[name] = TensorSlice.of(numel, np.concatenate(runs) if runs else [])
    return slices


@dataclass(frozen=True)
class SliceReads:
    """What one worker reads of each pushed tensor of a layout: a sliced tensor through
    the views its plan's copies read, the others whole (``whole``: name -> why); a tensor
    its model holds nothing of, not at all.

    Examples:
        >>> import torch
        >>> from torchrl_vllm_ext.weight_sync.loading.recorder import trace
        >>> model = torch.nn.Linear(2, 1, bias=False).requires_grad_(False)
        >>> def load_weights(weights):  # rank 0 of 2 of a row-parallel layer
        ...     for _, w in weights:
        ...         model.weight.data.copy_(w[:, :2])
        >>> plan = trace(load_weights, [("w", torch.ones(1, 4))], dict(model.named_parameters()))
        >>> reads = slice_reads(plan)
        >>> reads.views["w"], reads.received_bytes, reads.kept_bytes, reads.whole
        ((View(offset=0, size=(1, 2), stride=(4, 1)),), 8, 8, {})
    """

    views: dict[str, tuple[View, ...]]
    """Sliced tensors: the views of each that the plan's copies read (read only those)."""
    whole: dict[str, str]
    """Tensors read whole: name -> why (the loader computes from it; every element kept)."""
    received_bytes: int
    """Bytes read: the views' (an element two copies read counts twice) and the whole
    tensors'."""
    kept_bytes: int
    """Bytes kept (:func:`kept_bytes`)."""
    sliced_received: int
    """Of ``received_bytes``, the sliced tensors' (their views)."""
    sliced_kept: int
    """Of ``kept_bytes``, the sliced tensors' (``sliced_received / sliced_kept``: 1.0 when
    no two copies read one element)."""


def slice_reads(plan: LoadPlan) -> SliceReads:
    """What a worker with ``plan`` reads of each tensor of its layout (:class:`SliceReads`)."""
    views: dict[str, list[View]] = {}
    for copy in plan.copies:
        views.setdefault(copy.source, []).append(copy.src)
    slices = plan_slices(plan)
    sliced, whole = {}, {}
    received = kept = sliced_received = sliced_kept = 0
    for name, shape, _, dtype, _ in plan.layout:
        s, size = slices[name], dtype.itemsize
        kept += s.kept * size
        if name in plan.loader:
            whole[name] = f"the loader computes from it ({plan.loader[name]})"
        elif s.whole:
            whole[name] = "this worker keeps every element (replicated, or all its own)"
        else:
            sliced[name] = tuple(views.get(name, ()))
            read = sum(v.numel for v in sliced[name]) * size
            received += read
            sliced_received += read
            sliced_kept += s.kept * size
            continue
        received += math.prod(shape) * size
    return SliceReads(sliced, whole, received, kept, sliced_received, sliced_kept)


def kept_bytes(plan: LoadPlan) -> int:
    """Bytes of the pushed tensors this worker keeps (its slices)."""
    itemsize = {name: dtype.itemsize for name, _, _, dtype, _ in plan.layout}
    return sum(s.kept * itemsize[name] for name, s in plan_slices(plan).items())
