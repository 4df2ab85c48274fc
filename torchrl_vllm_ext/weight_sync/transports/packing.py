"""Packed buckets: same-dtype tensors laid end to end, shared by the packed transports.

One update = one header (names, dtypes, shapes, bucket layout, checksums, version) and a
few large buffers: broadcast sends one collective per bucket (:mod:`.broadcast`), CUDA IPC
shares each bucket's memory (:mod:`.ipc`); never one call per tensor. The workers read
the tensors back as views (:func:`unpack`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchrl_vllm_ext.weight_sync.params import device_checksum, dtype_name, torch_dtype
from torchrl_vllm_ext.weight_sync.specs import BucketSpec, TensorSpec, UpdateHeader

DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass(frozen=True)
class Packed:
    """One version packed: its header and the uint8 buffers, in header order."""

    header: UpdateHeader
    buffers: list[torch.Tensor]

    @property
    def version(self) -> str:
        return self.header.version

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def __iter__(self):  # header, buffers = pack(...)
        return iter((self.header, self.buffers))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor, as a view into its bucket."""
        return {
            name: t
            for bucket, buf in zip(self.header.buckets, self.buffers, strict=True)
            for name, t in unpack(bucket, buf)
        }


def pack(
    tensors: dict[str, torch.Tensor], version: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Packed:
    """Pack same-dtype tensors end to end into buckets of about ``bucket_bytes``, on the
    tensors' device. A tensor larger than ``bucket_bytes`` gets a bucket of its own.
    """
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        by_dtype.setdefault(t.dtype, []).append((name, t))
    groups: list[list[tuple[str, torch.Tensor]]] = []
    for items in by_dtype.values():
        current, size = [], 0
        for name, t in items:
            nbytes = t.numel() * t.element_size()
            if current and size + nbytes > bucket_bytes:
                groups.append(current)
                current, size = [], 0
            current.append((name, t))
            size += nbytes
        if current:
            groups.append(current)
    specs, buffers = [], []
    for group in groups:
        buf = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in group])
        specs.append(
            BucketSpec(
                dtype=dtype_name(group[0][1].dtype),
                tensors=tuple(TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in group),
                nbytes=buf.numel(),
                checksum=device_checksum(buf),
            )
        )
        buffers.append(buf)
    return Packed(UpdateHeader(version=str(version), buckets=tuple(specs)), buffers)


def unpack(bucket: BucketSpec, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of the tensors packed end to end in ``buffer`` (uint8)."""
    dtype = torch_dtype(bucket.dtype)
    out, offset = [], 0
    for spec in bucket.tensors:
        numel = 1
        for d in spec.shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        out.append((spec.name, buffer[offset : offset + nbytes].view(dtype).view(spec.shape)))
        offset += nbytes
    return out
