"""A sharded push's broadcast step: a streamed gather, bucket by bucket, every rank in
lockstep; rank 0 hands each bucket to the broadcast transport as it completes.

The gathers run on the trainer's own communicator (the DTensors' mesh: one ``gather`` to
rank 0 per bucket for FSDP2's 1-D mesh, else ``full_tensor`` per parameter), in the ranks'
main threads; the send runs on the broadcast group's (rank 0 and the
replicas' workers), in the transport's sending thread. The two never share a
communicator, and a queue of one bucket between them bounds rank 0's memory to its
shards, the bucket being sent and the one being gathered (:class:`Handoff`), and the
gather's receive buffers; the other ranks hold what they send.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Iterator, Sequence

import torch

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.weight_sync.params import torch_dtype
from torchrl_vllm_ext.weight_sync.sharded.layout import block, describe, region_of
from torchrl_vllm_ext.weight_sync.specs import BucketSpec, TensorSpec, UpdateHeader
from torchrl_vllm_ext.weight_sync.transports.packing import bucket_groups

HANDOFF_POLL_S = 0.1
"""How often rank 0's gather looks whether the push it feeds has ended early."""


def bucket_plan(specs: Sequence[TensorSpec], bucket_bytes: int) -> tuple[tuple[int, ...], ...]:
    """The buckets of a push of ``specs`` (in push order), as indices into ``specs``: the
    same on every rank, and the layout of :mod:`...packing`."""
    groups = bucket_groups([(s.dtype, nbytes_of(s)) for s in specs], bucket_bytes)
    return tuple(tuple(g) for g in groups)


def header_of(
    specs: Sequence[TensorSpec], buckets: Sequence[Sequence[int]], version: str
) -> UpdateHeader:
    """The broadcast header of those buckets, their checksums to follow them."""
    out = []
    for indices in buckets:
        tensors = tuple(specs[i] for i in indices)
        nbytes = sum(nbytes_of(t) for t in tensors)
        out.append(BucketSpec(dtype=tensors[0].dtype, tensors=tensors, nbytes=nbytes, checksum=0))
    return UpdateHeader(version=version, buckets=tuple(out), checksums_follow=True)


def nbytes_of(spec: TensorSpec) -> int:
    """Bytes of the whole tensor ``spec`` describes."""
    return torch_dtype(spec.dtype).itemsize * math.prod(spec.shape)


def gathered(
    state: dict[str, torch.Tensor],
    specs: Sequence[TensorSpec],
    buckets: Sequence[Sequence[int]],
    keep: bool,
    group=None,
) -> Iterator[torch.Tensor | None]:
    """Each bucket gathered from every rank's shards, in the same order on every rank;
    ``keep``: this rank (rank 0 of ``group``, the push's) packs and yields the bucket,
    else it takes part in the gathers and yields None.

    A bucket whose DTensors all lie on one 1-D mesh over ``group`` (FSDP2's) is one
    ``gather`` to rank 0: each rank sends its blocks end to end and rank 0 places them
    (:func:`.layout.region_of`); any other layout, one ``full_tensor()`` per parameter.
    """
    for indices in buckets:
        tensors = [specs[i] for i in indices]
        names = [t.name for t in tensors]
        device = state[names[0]].device  # a GPU trainer's buckets stay on its GPU
        mesh_group = _one_mesh_group(state, names, group)
        if mesh_group is not None:
            yield _gather_bucket(state, tensors, mesh_group, keep, device)
        else:
            yield _full_tensors(state, tensors, keep, device)


def _one_mesh_group(state, names: list[str], group):
    """The process group of the one 1-D mesh, over ``group``'s ranks in order, that every
    DTensor of ``names`` lies on, placed by Shard / Replicate; None otherwise."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard

    meshes = {t.device_mesh for n in names if isinstance(t := state[n], DTensor)}
    if len(meshes) != 1:
        return None
    mesh = meshes.pop()
    placed = all(
        type(p) in (Shard, Replicate)
        for n in names
        if isinstance(state[n], DTensor)
        for p in state[n].placements
    )
    if mesh.ndim != 1 or not placed:
        return None
    mesh_group = mesh.get_group(0)
    push_ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    return mesh_group if dist.get_process_group_ranks(mesh_group) == push_ranks else None


def _gather_bucket(
    state, specs: list[TensorSpec], group, keep: bool, device
) -> torch.Tensor | None:
    """One bucket in one gather to rank 0 (see :func:`gathered`)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    world, me = dist.get_world_size(group), dist.get_rank(group)
    sent = []  # (spec index, rank, region, bytes): each block, in the order its rank sends
    for k, spec in enumerate(specs):
        tensor = state[spec.name]
        if not isinstance(tensor, DTensor):
            continue  # replicated everywhere: rank 0's own
        placements = tuple(describe(spec.name, p) for p in tensor.placements)
        for r in range(world):
            region, writes = region_of(tuple(spec.shape), placements, (world,), (r,))
            nbytes = math.prod(n for _, n in region) * torch_dtype(spec.dtype).itemsize
            if writes and nbytes:
                sent.append((k, r, region, nbytes))
    width = max((sum(b[3] for b in sent if b[1] == r) for r in range(world)), default=0)
    payload = torch.empty(width, dtype=torch.uint8, device=device)
    offset = 0
    for k, r, _, nbytes in sent:
        if r == me:
            local = state[specs[k].name].to_local().contiguous()
            payload[offset : offset + nbytes].copy_(local.view(-1).view(torch.uint8))
            offset += nbytes
    received = [torch.empty_like(payload) for _ in range(world)] if keep else None
    dist.gather(payload, gather_list=received, dst=dist.get_global_rank(group, 0), group=group)
    if not keep:
        return None
    bucket, views = _bucket_views(specs, device)
    for spec, view in zip(specs, views, strict=True):
        if not isinstance(state[spec.name], DTensor):
            view.copy_(state[spec.name].detach())
    offsets = [0] * world
    for k, r, region, nbytes in sent:
        lengths = tuple(n for _, n in region)
        piece = received[r][offsets[r] : offsets[r] + nbytes].view(views[k].dtype).view(lengths)
        block(views[k], region).copy_(piece)
        offsets[r] += nbytes
    return bucket


def _full_tensors(state, specs: list[TensorSpec], keep: bool, device) -> torch.Tensor | None:
    """One bucket, one ``full_tensor()`` (an all-gather) per parameter."""
    from torch.distributed.tensor import DTensor

    bucket, views = _bucket_views(specs, device) if keep else (None, None)
    for k, spec in enumerate(specs):
        tensor = state[spec.name]
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if keep:
            views[k].copy_(full.detach())
        del full
    return bucket


def _bucket_views(specs: list[TensorSpec], device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A new bucket for ``specs`` and each tensor's view into it (packing's layout)."""
    bucket = torch.empty(sum(nbytes_of(s) for s in specs), dtype=torch.uint8, device=device)
    views, offset = [], 0
    for spec in specs:
        size = nbytes_of(spec)
        view = bucket[offset : offset + size].view(torch_dtype(spec.dtype))
        views.append(view.view(tuple(spec.shape)))
        offset += size
    return bucket, views


class Handoff:
    """Rank 0's buckets between its gather (the main thread) and the sending thread: at
    most ``in_flight`` alive at once, one being sent and one being gathered; a bucket's
    room is given back once the sender asks for the next one (it sent this one)."""

    def __init__(self, in_flight: int = 2):
        self._queue: queue.Queue = queue.Queue()
        self._room = threading.Semaphore(in_flight)

    def feed(self, buckets: Iterator[torch.Tensor | None], ended) -> None:
        """Put each bucket for the sender, then None (or the error that stopped the
        gather, which fails the send). Once the push has ``ended()`` (failed before
        taking every bucket) the rest are gathered still, in lockstep with the other
        ranks, and dropped."""
        it = iter(buckets)
        try:
            while self._room_or_ended(ended):
                bucket = next(it, None)
                self._queue.put(bucket)
                if bucket is None:
                    return
            for _ in it:
                pass
        except BaseException as e:
            self._queue.put(e)
            raise

    def _room_or_ended(self, ended) -> bool:
        while not ended():
            if self._room.acquire(timeout=HANDOFF_POLL_S):
                return True
        return False

    def taken(self) -> Iterator[torch.Tensor]:
        """The sending thread's side: the buckets as they come, until None; an error put
        in their place is raised (the send fails, naming it)."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise WeightSyncError(
                    f"the trainer's ranks stopped gathering the buckets "
                    f"({type(item).__name__}: {item}); nothing was loaded."
                ) from item
            yield item
            del item
            self._room.release()
