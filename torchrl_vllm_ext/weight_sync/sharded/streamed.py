"""A sharded push's broadcast step: a streamed gather, bucket by bucket, every rank in
lockstep; rank 0 hands each bucket to the broadcast transport as it completes.

The gathers run on the trainer's own communicator (each DTensor's mesh: ``full_tensor``),
in the ranks' main threads; the send runs on the broadcast group's (rank 0 and the
replicas' workers), in the transport's sending thread. The two never share a
communicator, and a queue of one bucket between them bounds rank 0's memory to its
shards, the bucket being sent and the one being gathered (the other ranks hold one
parameter gathered at a time).
"""

from __future__ import annotations

import queue
from collections.abc import Iterator

import torch

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.weight_sync.params import torch_dtype
from torchrl_vllm_ext.weight_sync.specs import BucketSpec, TensorSpec, UpdateHeader
from torchrl_vllm_ext.weight_sync.transports.packing import bucket_groups

HANDOFF_POLL_S = 0.1
"""How often rank 0's gather looks whether the push it feeds has ended early."""


def bucket_plan(specs: list[list], bucket_bytes: int) -> list[list[int]]:
    """The buckets of a push of ``specs`` ([name, shape, dtype] in push order), as indices
    into ``specs``: the same on every rank, and the layout of :mod:`...packing`."""
    items = [(dtype, _nbytes(shape, dtype)) for _, shape, dtype in specs]
    return bucket_groups(items, bucket_bytes)


def header_of(specs: list[list], buckets: list[list[int]], version: str) -> UpdateHeader:
    """The broadcast header of those buckets, their checksums to follow them."""
    out = []
    for indices in buckets:
        tensors = tuple(TensorSpec(specs[i][0], specs[i][2], tuple(specs[i][1])) for i in indices)
        nbytes = sum(_nbytes(specs[i][1], specs[i][2]) for i in indices)
        out.append(
            BucketSpec(dtype=specs[indices[0]][2], tensors=tensors, nbytes=nbytes, checksum=0)
        )
    return UpdateHeader(version=version, buckets=tuple(out), checksums_follow=True)


def _nbytes(shape, dtype: str) -> int:
    n = torch_dtype(dtype).itemsize
    for d in shape:
        n *= d
    return n


def gathered(
    state: dict[str, torch.Tensor], specs: list[list], buckets: list[list[int]], keep: bool
) -> Iterator[torch.Tensor | None]:
    """Each bucket gathered from every rank's shards (a collective per parameter, in the
    same order on every rank); ``keep``: this rank packs and yields the bucket (rank 0),
    else it takes part in the gathers and yields None."""
    from torch.distributed.tensor import DTensor

    for indices in buckets:
        nbytes = sum(_nbytes(specs[i][1], specs[i][2]) for i in indices)
        device = state[specs[indices[0]][0]].device  # a GPU trainer's buckets stay on its GPU
        bucket = torch.empty(nbytes, dtype=torch.uint8, device=device) if keep else None
        offset = 0
        for i in indices:
            name, _, _ = specs[i]
            tensor = state[name]
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            size = full.numel() * full.element_size()
            if keep:
                bucket[offset : offset + size].copy_(full.detach().reshape(-1).view(torch.uint8))
            offset += size
            del full
        yield bucket


def hand_off(buckets: Iterator[torch.Tensor | None], into: queue.Queue, ended) -> None:
    """Rank 0: put each bucket into ``into`` for the sending thread, then None (or the
    error that stopped the gather, which fails the send). Once the push has ``ended()``
    (failed before taking every bucket) the rest are gathered still, in lockstep with the
    other ranks, and dropped."""
    try:
        for bucket in buckets:
            _put(into, bucket, ended)
    except BaseException as e:
        _put(into, e, ended)
        raise
    _put(into, None, ended)


def _put(into: queue.Queue, item, ended) -> None:
    while not ended():
        try:
            into.put(item, timeout=HANDOFF_POLL_S)
            return
        except queue.Full:
            continue


def taken(source: queue.Queue) -> Iterator[torch.Tensor]:
    """The sending thread's side: the buckets as they come, until None; an error put in
    their place is raised (the send fails, naming it)."""
    while True:
        item = source.get()
        if item is None:
            return
        if isinstance(item, BaseException):
            raise WeightSyncError(
                f"the trainer's ranks stopped gathering the buckets ({type(item).__name__}: "
                f"{item}); nothing was loaded."
            ) from item
        yield item
