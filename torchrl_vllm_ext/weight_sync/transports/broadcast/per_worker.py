"""Per-worker sends: each worker of a tensor-parallel replica receives, point to point in
the broadcast group, only the bytes it keeps (its slices, read off its load plan:
:mod:`...loading.slices`), not every byte of every tensor.

The worker reports its slices as element runs by tensor name (plain data:
:func:`worker_runs`); the sender cuts the packed buckets by them into one payload per
worker (:func:`byte_runs`, :func:`gather`), checksums it and sends it to that worker
alone; the worker checks the checksum and writes the payload back at its positions in
its whole-sized receive buffers (:func:`scatter`), then loads through its plan, which
reads only those positions. A tensor the worker keeps whole (the loader computes from
it, a replicated norm) goes whole. :func:`broadcast_reason` and :func:`choose_route` say,
with the reason, whether a push goes this way or as one broadcast of every byte to every
worker.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import torch

from torchrl_vllm_ext.weight_sync.loading.slices import TensorSlice, merge_runs
from torchrl_vllm_ext.weight_sync.params import torch_dtype
from torchrl_vllm_ext.weight_sync.specs import UpdateHeader

Runs = dict[str, list[list[int]]]
"""Tensor name -> the ``[start, stop)`` element runs a worker keeps of it (flattened,
contiguous layout): what a worker reports (plain data)."""

BROADCAST = "broadcast"
"""The route that sends every worker every byte (one collective per bucket)."""
PER_WORKER = "per-worker"
"""The route that sends each worker only its slices, point to point."""


def worker_runs(slices: dict[str, TensorSlice]) -> Runs:
    """A worker's slices as plain data (what it reports to the sender).

    Examples:
        >>> worker_runs({"w": TensorSlice.of(8, [(4, 6), (0, 2)])})
        {'w': [[0, 2], [4, 6]]}
    """
    return {name: [list(run) for run in s.runs] for name, s in slices.items()}


def runs_digest(runs: Runs) -> str:
    """A digest of ``runs``: the sender names the runs it cut a payload by, the worker
    checks that they are the ones it holds.

    Examples:
        >>> runs_digest({"w": [[0, 2]]}) == runs_digest({"w": [[0, 2]]})
        True
        >>> runs_digest({"w": [[0, 2]]}) == runs_digest({"w": [[0, 3]]})
        False
    """
    text = json.dumps(sorted(runs.items()), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def byte_runs(header: UpdateHeader, runs: Runs) -> np.ndarray:
    """``[bucket, start, stop)`` byte runs of the packed buckets of ``header`` that hold
    the elements of ``runs``, in bucket order, touching runs merged: what a worker
    receives, in the order it is packed. Every tensor of the header must be named.

    Examples:
        >>> from torchrl_vllm_ext.weight_sync.transports.packing import pack
        >>> header = pack({"a": torch.zeros(4), "b": torch.zeros(2)}, "1").header
        >>> byte_runs(header, {"a": [[1, 2]], "b": [[0, 2]]}).tolist()
        [[0, 4, 8], [0, 16, 24]]
        >>> byte_runs(header, {"a": [[2, 4]], "b": [[0, 2]]}).tolist()  # touching: one
        [[0, 8, 24]]
    """
    out = []
    for i, bucket in enumerate(header.buckets):
        size, offset, pieces = torch_dtype(bucket.dtype).itemsize, 0, []
        for spec in bucket.tensors:
            numel = math.prod(spec.shape)
            kept = np.asarray(runs[spec.name], dtype=np.int64).reshape(-1, 2)
            if len(kept) and (kept.min() < 0 or kept.max() > numel):
                raise ValueError(
                    f"runs of {spec.name} reach past its {numel} elements: {kept.tolist()[:4]}"
                )
            pieces.append(offset + kept * size)
            offset += numel * size
        merged = merge_runs(np.concatenate(pieces)) if pieces else []
        out.extend((i, start, stop) for start, stop in merged if stop > start)
    return np.asarray(out, dtype=np.int64).reshape(-1, 3)


Cuts = dict[tuple, np.ndarray]
"""``(runs digest, bucket layout)`` -> :func:`byte_runs`: worked out once per layout."""


def cut_runs(header: UpdateHeader, runs: Runs, digest: str, cuts: Cuts) -> np.ndarray:
    """:func:`byte_runs` of ``runs`` in ``header``'s buckets, kept in ``cuts`` (the
    buckets' tensors and the digest of ``runs`` name them), so each push of a layout
    does not work them out again.

    Examples:
        >>> from torchrl_vllm_ext.weight_sync.transports.packing import pack
        >>> header, cuts = pack({"a": torch.zeros(4)}, "1").header, {}
        >>> runs = {"a": [[1, 2]]}
        >>> cut_runs(header, runs, runs_digest(runs), cuts).tolist(), len(cuts)
        ([[0, 4, 8]], 1)
    """
    key = (digest, tuple(b.tensors for b in header.buckets))
    if key not in cuts:
        while len(cuts) >= 8:  # layouts of the past
            cuts.pop(next(iter(cuts)))
        cuts[key] = byte_runs(header, runs)
    return cuts[key]


def strided(runs: np.ndarray) -> list[tuple[int, int, int, int, int]]:
    """``runs`` (:func:`byte_runs`) as ``(bucket, start, count, length, step)`` groups of
    equal runs at a constant step (a column shard: one group per tensor, not one run per
    row), so that cutting and writing back take one strided copy per group.

    Examples:
        >>> strided(np.array([[0, 0, 2], [0, 4, 6], [0, 8, 10], [0, 11, 12], [1, 0, 4]]))
        [(0, 0, 3, 2, 4), (0, 11, 1, 1, 1), (1, 0, 1, 4, 4)]
    """
    rows, groups, i = runs.tolist(), [], 0
    while i < len(rows):
        bucket, start, stop = rows[i]
        length, step, j = stop - start, None, i + 1
        while j < len(rows) and rows[j][0] == bucket and rows[j][2] - rows[j][1] == length:
            gap = rows[j][1] - rows[j - 1][1]
            if step is not None and gap != step:
                break
            step, j = gap, j + 1
        groups.append((bucket, start, j - i, length, length if step is None else step))
        i = j
    return groups


def _block(buffer: torch.Tensor, start: int, count: int, length: int, step: int) -> torch.Tensor:
    """The ``count`` runs of ``length`` bytes from ``start``, ``step`` apart, as a view."""
    return buffer[start:].as_strided((count, length), (step, 1))


def gather(
    buffers: list[torch.Tensor], runs: np.ndarray, into: torch.Tensor | None = None
) -> torch.Tensor:
    """The bytes of ``runs`` (:func:`byte_runs`) of the packed ``buffers``, end to end:
    one worker's payload (written into ``into``, a payload of an earlier push, when it
    has the size and device: no fresh pages to fault in).

    Examples:
        >>> buffers = [torch.arange(10, dtype=torch.uint8)]
        >>> gather(buffers, np.array([[0, 1, 3], [0, 7, 8]])).tolist()
        [1, 2, 7]
    """
    device = buffers[0].device if buffers else torch.device("cpu")
    total = int((runs[:, 2] - runs[:, 1]).sum()) if len(runs) else 0
    if into is not None and into.numel() == total and into.device == device:
        payload = into
    else:
        payload = torch.empty(total, dtype=torch.uint8, device=device)
    at = 0
    for b, *group in strided(runs):  # one copy of each group, straight into the payload
        block = _block(buffers[b], *group)
        payload[at : at + block.numel()].view(block.shape).copy_(block)
        at += block.numel()
    return payload


def scatter(payload: torch.Tensor, runs: np.ndarray, buffers: list[torch.Tensor]) -> None:
    """Write ``payload`` (:func:`gather`'s) back at its ``runs`` in ``buffers``.

    Examples:
        >>> buffers = [torch.zeros(10, dtype=torch.uint8)]
        >>> scatter(torch.tensor([1, 2, 7], dtype=torch.uint8), np.array([[0, 1, 3], [0, 7, 8]]), buffers)
        >>> buffers[0].tolist()
        [0, 1, 2, 0, 0, 0, 0, 7, 0, 0]
    """
    total = int((runs[:, 2] - runs[:, 1]).sum()) if len(runs) else 0
    if total != payload.numel():
        raise ValueError(f"a payload of {payload.numel()} bytes for runs of {total}")
    groups = strided(runs)
    pieces = payload.split([count * length for _, _, count, length, _ in groups])
    for (b, *group), piece in zip(groups, pieces, strict=True):
        block = _block(buffers[b], *group)
        block.copy_(piece.view(block.shape))


def broadcast_reason(
    backend: str, workers_per_replica: int, delta_pushes: bool, per_worker_sends: bool = True
) -> str | None:
    """Why every worker is sent every byte whatever its slices (None: per-worker sends may
    be done, once every worker reports its slices: :func:`choose_route`).

    Examples:
        >>> broadcast_reason("gloo", 1, False)
        'one worker per replica keeps every byte'
        >>> broadcast_reason("gloo", 2, False) is None
        True
    """
    if not per_worker_sends:
        return "per-worker sends are off (per_worker_sends=False)"
    if workers_per_replica < 2:
        return "one worker per replica keeps every byte"
    if backend != "gloo":
        return f"per-worker sends are done over gloo only, not {backend}"
    if delta_pushes:
        return "delta pushes on: the workers hold every byte (a delta's base)"
    return None


def choose_route(reported: dict[int, list[Runs | None]]) -> tuple[str, str]:
    """How a full push reaches the workers, once :func:`broadcast_reason` allows
    per-worker sends: ``(route, why)``, :data:`PER_WORKER` when every worker of every
    replica reported its slices, else :data:`BROADCAST`. ``reported``: per replica, each
    worker's runs (None: no load plan of this layout yet, or one that would not replay now).

    Examples:
        >>> choose_route({0: [{"w": [[0, 2]]}, {"w": [[2, 4]]}]})
        ('per-worker', 'each worker is sent only the slices its load plan keeps')
        >>> choose_route({0: [{"w": [[0, 2]]}, None]})[1]
        'worker 1 of replica 0 has no load plan of this layout to replay (the first push of a layout traces it)'
    """
    if not reported:
        return BROADCAST, "no replica reported its workers' slices"
    for rid, workers in sorted(reported.items()):
        for rank, runs in enumerate(workers):
            if runs is None:
                return BROADCAST, (
                    f"worker {rank} of replica {rid} has no load plan of this layout to "
                    "replay (the first push of a layout traces it)"
                )
    return PER_WORKER, "each worker is sent only the slices its load plan keeps"
