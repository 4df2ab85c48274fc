"""CUDA IPC handles of the trainer's packed buckets, as plain data (the colocated route).

The trainer packs its tensors into buckets on its own GPU (:mod:`..packing`), shares
each with :func:`share` (torch's ``reduce_tensor``: a cudaIpcMemHandle, a ref counter that
keeps the allocation alive while anyone maps it, and an event to wait on), and sends the
handles as JSON (:class:`~torchrl_vllm_ext.weight_sync.specs.IpcUpdate`): no pickle crosses (DESIGN.md). A worker on
the same GPU opens them with :func:`open_bucket`, mapping the GPU's UUID to its own device
number, checksums them on the GPU, and in its pause copies them into the parameters.
Only :func:`share` and :func:`open_bucket` need CUDA; the
encoding is unit-tested on CPU.
"""

from __future__ import annotations

import base64
import weakref
from collections.abc import Callable, Hashable, Sequence

import torch

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.weight_sync.specs import CudaIpcHandle
from torchrl_vllm_ext.weight_sync.transports.devices import device_uuid, local_device_index

_STORAGE_CLASSES = {
    f"{cls.__module__}.{cls.__qualname__}": cls
    for cls in (torch.storage.TypedStorage, torch.storage.UntypedStorage)
}


def _b64(raw: bytes | None) -> str:
    return base64.b64encode(raw or b"").decode()


def handle_from_args(args: tuple, gpu: str) -> CudaIpcHandle:
    """:class:`CudaIpcHandle` of ``reduce_tensor``'s rebuild arguments for a 1-D uint8
    tensor on the GPU ``gpu`` (normalised UUID)."""
    (
        _tensor_cls,
        size,
        _stride,
        offset,
        storage_cls,
        dtype,
        _device,
        storage_handle,
        storage_size_bytes,
        storage_offset_bytes,
        _requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = args
    if dtype != torch.uint8 or len(size) != 1:
        raise WeightSyncError(f"only 1-D uint8 buckets are shared, not {dtype} {tuple(size)}.")
    name = f"{storage_cls.__module__}.{storage_cls.__qualname__}"
    if name not in _STORAGE_CLASSES:
        raise WeightSyncError(
            f"storage class {name} is not one of torch's {list(_STORAGE_CLASSES)}."
        )
    return CudaIpcHandle(
        gpu=gpu,
        numel=int(size[0]),
        offset=int(offset),
        storage_cls=name,
        storage_handle=_b64(storage_handle),
        storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes),
        ref_counter_handle=_b64(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=_b64(event_handle),
        event_sync_required=bool(event_sync_required),
    )


def rebuild_args(handle: CudaIpcHandle, device_index: int) -> tuple:
    """torch's ``rebuild_cuda_tensor`` arguments for ``handle`` on this process's device
    ``device_index`` (the plain-data inverse of :func:`handle_from_args`)."""
    storage_cls = _STORAGE_CLASSES.get(handle.storage_cls)
    if storage_cls is None:
        raise WeightSyncError(
            f"storage class {handle.storage_cls!r} is not one of torch's {list(_STORAGE_CLASSES)}."
        )
    return (
        torch.Tensor,
        torch.Size([handle.numel]),
        (1,),
        handle.offset,
        storage_cls,
        torch.uint8,
        device_index,
        base64.b64decode(handle.storage_handle),
        handle.storage_size_bytes,
        handle.storage_offset_bytes,
        False,
        base64.b64decode(handle.ref_counter_handle),
        handle.ref_counter_offset,
        base64.b64decode(handle.event_handle) or None,
        handle.event_sync_required,
    )


def share(buf: torch.Tensor) -> CudaIpcHandle:
    """Share a 1-D uint8 CUDA tensor (a packed bucket) with other processes on its GPU.
    The caller keeps ``buf`` alive until every receiver has loaded from it."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buf)
    return handle_from_args(args, device_uuid(buf.device.index))


def open_bucket(handle: CudaIpcHandle) -> torch.Tensor:
    """The trainer's bucket, mapped into this process (no copy): a uint8 CUDA tensor."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(*rebuild_args(handle, local_device_index(handle.gpu)))


class SharedBuckets:
    """The trainer's side: each set of buckets shared once per receiving process; the same
    handles for every push re-packed into it (sets are told apart by their first buffer,
    held weakly).

    Once per receiver, not once for all: each share gives the allocation a reference
    counter set to 1, which the one process that maps it counts down when it unmaps;
    torch frees the trainer's memory when it reaches 0. Two processes on one share would
    take it below 0, and the memory would never be freed (or be freed while one still
    maps it).

    Examples:
        >>> shared, calls = SharedBuckets(), []
        >>> def fake_share(buf):
        ...     calls.append(buf)
        ...     return f"handle-{len(calls)}"
        >>> buffers = [torch.zeros(4, dtype=torch.uint8)]
        >>> [shared.handles(buffers, r, fake_share) for r in ("r0", "r0", "r1")]
        [('handle-1',), ('handle-1',), ('handle-2',)]
    """

    def __init__(self):
        self._sets: dict[tuple, tuple[weakref.ref, int, tuple]] = {}

    def handles(
        self,
        buffers: Sequence[torch.Tensor],
        receiver: Hashable,
        share_fn: Callable | None = None,
    ) -> tuple:
        """The handles of ``buffers`` for ``receiver`` (one process:
        :attr:`~torchrl_vllm_ext.engine.fleet.ReplicaView.process`)."""
        share_fn = share_fn or share
        self._sets = {k: v for k, v in self._sets.items() if v[0]() is not None}
        first = buffers[0]
        key = (id(first), receiver)
        known = self._sets.get(key)
        if known is not None and known[0]() is first and known[1] == len(buffers):
            return known[2]
        handles = tuple(share_fn(b) for b in buffers)
        self._sets[key] = (weakref.ref(first), len(buffers), handles)
        return handles

    def clear(self) -> None:
        self._sets.clear()


def bucket_key(handle: CudaIpcHandle) -> tuple:
    """What identifies a shared bucket across updates: its GPU, allocation and place in it."""
    return (
        handle.gpu,
        handle.storage_handle,
        handle.storage_offset_bytes,
        handle.offset,
        handle.numel,
    )


class OpenedBuckets:
    """A worker's side: the trainer's buckets opened once and kept while the trainer keeps
    sharing them (its two sets, A and B): an update whose handles were opened before maps
    nothing new. Mappings of buckets in neither of the last two updates are dropped (the
    trainer's memory is freed once nobody maps it); :meth:`clear` drops them all.

    Examples:
        >>> opened, count = OpenedBuckets(lambda h: object()), 0
        >>> h = [CudaIpcHandle("g", 4, 0, "s", f"h{i}", 4, 0, "r", 0, "", False) for i in range(3)]
        >>> a = opened.open([h[0]]); b = opened.open([h[1]]); again = opened.open([h[0]])
        >>> again[0] is a[0], opened.opened
        (True, 2)
        >>> _ = opened.open([h[2]]); len(opened)  # h[1] is in neither of the last two
        2
    """

    def __init__(self, open_fn: Callable[[CudaIpcHandle], torch.Tensor] | None = None):
        self._open = open_fn or open_bucket
        self._maps: dict[tuple, torch.Tensor] = {}
        self._last: tuple[set, set] = (set(), set())
        self.opened = 0
        """How many buckets were opened (mapped) so far."""

    def __len__(self) -> int:
        return len(self._maps)

    def open(self, handles: Sequence[CudaIpcHandle]) -> list[torch.Tensor]:
        keys = [bucket_key(h) for h in handles]
        out = []
        for key, handle in zip(keys, handles, strict=True):
            if key not in self._maps:
                self._maps[key] = self._open(handle)
                self.opened += 1
            out.append(self._maps[key])
        current = set(keys)
        self._last = (self._last[1], current)
        keep = self._last[0] | current
        self._maps = {k: v for k, v in self._maps.items() if k in keep}
        return out

    def clear(self) -> None:
        self._maps.clear()
        self._last = (set(), set())
