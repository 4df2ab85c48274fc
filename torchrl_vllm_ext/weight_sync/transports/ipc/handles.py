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
