"""Where each rank's part of each tensor lies in the full tensor, as plain data.

A DTensor's placements on its mesh say which block of the full tensor a rank holds:
``Shard(d)`` on a mesh dimension of size ``n`` cuts tensor dimension ``d`` as
``torch.chunk`` does (chunks of ``ceil(L / n)``, the last ones shorter or empty), nested
in mesh-dimension order; ``Replicate`` leaves it whole, and of the ranks holding the same
block only the one at coordinate 0 of every replicated mesh dimension writes it. A plain
tensor is replicated on every rank: rank 0 writes it. ``Partial`` (a pending reduction)
and FSDP2 + TP's strided shards are refused: their bytes are not a block of the tensor.

The functions here take placements as plain tuples (``("shard", d)``, ``("replicate",)``),
so the logic is unit-tested without a process group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from torchrl_vllm_ext.errors import ShardedPushError
from torchrl_vllm_ext.weight_sync.params import dtype_name

Placement = tuple
"""``("shard", dim)`` or ``("replicate",)``."""


@dataclass(frozen=True)
class Part:
    """One rank's part of one tensor."""

    name: str
    shape: tuple[int, ...]
    """The full tensor's shape."""
    dtype: str
    region: tuple[tuple[int, int], ...]
    """``(start, length)`` of the block along every dimension."""
    writes: bool
    """Whether this rank writes the block (one rank per distinct block)."""

    @property
    def numel(self) -> int:
        return math.prod(length for _, length in self.region)


def chunk(start: int, length: int, parts: int, index: int) -> tuple[int, int]:
    """``torch.chunk``'s block ``index`` of ``parts`` of the range ``(start, length)``.

    Examples:
        >>> [chunk(0, 5, 2, i) for i in range(2)], chunk(0, 2, 4, 3)
        ([(0, 3), (3, 2)], (2, 0))
    """
    size = -(-length // parts) if length else 0
    lo = min(index * size, length)
    return start + lo, min(size, length - lo)


def region_of(
    shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
) -> tuple[tuple[tuple[int, int], ...], bool]:
    """The block a rank at ``coordinate`` of a mesh holds, and whether it writes it.

    Examples:
        >>> region_of((5, 4), (("shard", 0),), (2,), (1,))
        (((3, 2), (0, 4)), True)
        >>> region_of((5, 4), (("replicate",), ("shard", 1)), (2, 2), (1, 0))
        (((0, 5), (0, 2)), False)
    """
    region = [(0, n) for n in shape]
    writes = True
    for placement, size, coord in zip(placements, mesh_shape, coordinate, strict=True):
        if placement[0] == "shard":
            dim = placement[1]
            region[dim] = chunk(*region[dim], size, coord)
        elif coord != 0:
            writes = False  # the block at coordinate 0 of this replicated mesh dim writes
    return tuple(region), writes


def describe(name: str, placement) -> Placement:
    """A torch placement as plain data; a typed error for one whose bytes are not a block."""
    from torch.distributed.tensor import Replicate, Shard

    kind = type(placement).__name__
    if type(placement) is Shard:
        return ("shard", placement.dim)
    if isinstance(placement, Replicate):
        return ("replicate",)
    raise ShardedPushError(
        f"parameter {name!r} is placed as {placement!r} ({kind}): a sharded push writes "
        "blocks of the full tensor, which Shard(dim) and Replicate are and a pending "
        "reduction (Partial) or a strided shard (FSDP2 over tensor parallel) is not. "
        "Redistribute it to Shard / Replicate before the push (DTensor.redistribute)."
    )


def part_of(name: str, tensor: torch.Tensor, rank: int) -> tuple[Part, torch.Tensor]:
    """This rank's :class:`Part` of ``tensor`` and the local tensor holding it."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        full = tuple((0, n) for n in tensor.shape)
        return Part(name, tuple(tensor.shape), dtype_name(tensor.dtype), full, rank == 0), tensor
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ShardedPushError(
            f"parameter {name!r} lives on a device mesh this rank ({rank}) is not in; every "
            "rank of the push's group must hold a part of every parameter.",
            (rank,),
        )
    placements = tuple(describe(name, p) for p in tensor.placements)
    region, writes = region_of(tuple(tensor.shape), placements, tuple(mesh.shape), coordinate)
    local = tensor.to_local()
    if tuple(local.shape) != tuple(length for _, length in region):
        raise ShardedPushError(
            f"parameter {name!r}: this rank ({rank}) holds a local shard of shape "
            f"{tuple(local.shape)} where placements {placements} on a mesh of shape "
            f"{tuple(mesh.shape)} give {tuple(length for _, length in region)}; the layout "
            "is one the push cannot place (padded or strided shards). Redistribute it.",
            (rank,),
        )
    return Part(name, tuple(tensor.shape), dtype_name(tensor.dtype), region, writes), local


def block(full: torch.Tensor, region: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The view of ``full`` a region covers."""
    view = full
    for dim, (start, length) in enumerate(region):
        if (start, length) != (0, full.shape[dim]):
            view = view.narrow(dim, start, length)
    return view


def assign(sizes: list[int], ranks: int) -> list[int]:
    """Which rank handles each item of ``sizes`` (bytes), balancing the bytes greedily:
    the largest first, each to the least loaded rank (ties: the lowest rank).

    Examples:
        >>> assign([10, 1, 1, 8], 2)
        [0, 1, 1, 1]
    """
    load = [0] * ranks
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += sizes[i]
    return owner
