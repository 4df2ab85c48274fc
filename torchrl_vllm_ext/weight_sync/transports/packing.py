"""Packed buckets: same-dtype tensors laid end to end, shared by the packed transports.

One update = one header (names, dtypes, shapes, bucket layout, checksums, version) and a
few large buffers: broadcast sends one collective per bucket (:mod:`.broadcast`), CUDA IPC
shares each bucket's memory (:mod:`.ipc`); never one call per tensor. The workers read
the tensors back as views (:func:`unpack`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.weight_sync.params import device_checksums, dtype_name, torch_dtype
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


def bucket_groups(items: list[tuple[str, int]], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``items`` ((dtype, nbytes) each) grouped by dtype in order, each group
    cut into buckets of about ``bucket_bytes`` (an item larger than that gets its own).

    Examples:
        >>> bucket_groups([("float32", 4), ("bfloat16", 2), ("float32", 4)], 6)
        [[0], [2], [1]]
    """
    by_dtype: dict[str, list[int]] = {}
    for i, (dtype, _) in enumerate(items):
        by_dtype.setdefault(dtype, []).append(i)
    groups: list[list[int]] = []
    for indices in by_dtype.values():
        current, size = [], 0
        for i in indices:
            nbytes = items[i][1]
            if current and size + nbytes > bucket_bytes:
                groups.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes
        if current:
            groups.append(current)
    return groups


def _groups(
    tensors: dict[str, torch.Tensor], bucket_bytes: int, dtype: torch.dtype | None = None
) -> list[list[tuple[str, torch.Tensor]]]:
    """Same-dtype tensors in order (as packed: ``dtype``, else their own), cut into groups
    of about ``bucket_bytes``."""
    named = list(tensors.items())
    items = [
        (dtype_name(dtype or t.dtype), t.numel() * (dtype or t.dtype).itemsize) for _, t in named
    ]
    return [[named[i] for i in group] for group in bucket_groups(items, bucket_bytes)]


def _fits(into: Packed, groups, device: torch.device, dtype: torch.dtype | None) -> bool:
    """Whether ``into``'s buckets hold exactly ``groups`` (names, dtypes, shapes, device)."""
    if len(into.header.buckets) != len(groups) or into.buffers[0].device != device:
        return False
    return all(
        bucket.tensors
        == tuple(TensorSpec(n, dtype_name(dtype or t.dtype), tuple(t.shape)) for n, t in group)
        for bucket, group in zip(into.header.buckets, groups, strict=True)
    )


def pack(
    tensors: dict[str, torch.Tensor],
    version: str,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    into: Packed | None = None,
    dtype: torch.dtype | None = None,
    checksums: bool = True,
) -> Packed:
    """Pack same-dtype tensors end to end into buckets of about ``bucket_bytes``, on the
    tensors' device. A tensor larger than ``bucket_bytes`` gets a bucket of its own.
    ``dtype``: cast every tensor to it as it is packed (the served dtype of a delta push).
    ``checksums=False``: the buckets' checksums are left 0 for the caller to fill in (a
    delta's: :func:`with_checksums`).

    ``into``: buckets of an earlier push to re-pack in place when they hold the same
    layout (one batched copy; the result shares ``into.buffers``), else new buffers. The
    checksums are batched (one host sync per device).

    Examples:
        >>> a = pack({"w": torch.ones(2), "b": torch.zeros(3)}, "1")
        >>> b = pack({"w": torch.full((2,), 2.0), "b": torch.zeros(3)}, "2", into=a)
        >>> b.buffers is a.buffers, b.tensors()["w"].tolist(), b.version
        (True, [2.0, 2.0], '2')
    """
    groups = _groups(tensors, bucket_bytes, dtype)
    if not groups:
        return Packed(UpdateHeader(version=str(version), buckets=()), [])
    device = groups[0][0][1].device
    if into is not None and into.buffers and _fits(into, groups, device, dtype):
        buffers = into.buffers
        dsts = [t for _, t in into.tensors().items()]
        torch._foreach_copy_(dsts, [t for group in groups for _, t in group])
    else:
        buffers = [
            torch.cat(
                [t.to(dtype or t.dtype).contiguous().view(-1).view(torch.uint8) for _, t in group]
            )
            for group in groups
        ]
    sums = device_checksums(buffers) if checksums else [0] * len(buffers)
    specs = tuple(
        BucketSpec(
            dtype=dtype_name(dtype or group[0][1].dtype),
            tensors=tuple(
                TensorSpec(n, dtype_name(dtype or t.dtype), tuple(t.shape)) for n, t in group
            ),
            nbytes=buf.numel(),
            checksum=sum_,
        )
        for group, buf, sum_ in zip(groups, buffers, sums, strict=True)
    )
    return Packed(UpdateHeader(version=str(version), buckets=specs), buffers)


def with_checksums(packed: Packed, sums: list[int] | None = None) -> Packed:
    """``packed`` with its buckets' checksums: ``sums``, or computed now."""
    sums = device_checksums(packed.buffers) if sums is None else sums
    buckets = tuple(
        dataclasses.replace(b, checksum=s) for b, s in zip(packed.header.buckets, sums, strict=True)
    )
    return Packed(dataclasses.replace(packed.header, buckets=buckets), packed.buffers)


def verify_checksums(version: str, got: list[int], sent: list[int], how: str) -> None:
    """Every bucket's checksum as received (``got``) against the trainer's (``sent``); a
    :class:`WeightSyncError` naming the first that differs (``how``: how it arrived).

    Examples:
        >>> verify_checksums("3", [7, 9], [7, 8], "read through CUDA IPC")
        Traceback (most recent call last):
        ...
        torchrl_vllm_ext.errors.WeightSyncError: bucket 1 of version 3 read through CUDA IPC does not match the trainer's (checksum 9 != 8); nothing was loaded.
    """
    for i, (have, want) in enumerate(zip(got, sent, strict=True)):
        if have != want:
            raise WeightSyncError(
                f"bucket {i} of version {version} {how} does not match the trainer's "
                f"(checksum {have} != {want}); nothing was loaded."
            )


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
