"""The weight-sync wire specs (plain data) and their JSON form.

The one module of wire formats every transport shares: a packed update is one
:class:`UpdateHeader` (buckets of :class:`TensorSpec`s; broadcast sends it to every worker,
CUDA IPC wraps it with a handle per bucket in an :class:`IpcUpdate`); a storage slot is
published with a :class:`SlotManifest` (a slot other processes write: a :class:`SlotTarget`
first). All cross processes as JSON, encoded and decoded
(with type checks) by :func:`to_json` and :func:`from_json`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import msgspec

T = TypeVar("T")


@dataclass(frozen=True)
class TensorSpec:
    """One parameter as it travels: Hugging Face name, dtype, shape and checksum."""

    name: str
    """Hugging Face parameter name (e.g. ``model.layers.0.mlp.up_proj.weight``)."""
    dtype: str
    """torch dtype name without the ``torch.`` prefix (``float32``, ``bfloat16``, ...)."""
    shape: tuple[int, ...]
    """Full (unsharded) shape."""
    checksum: int = 0
    """Sum of the tensor's bytes read as uint64 words, mod 2**64 (see weight_sync.checksum)."""


@dataclass(frozen=True)
class BucketSpec:
    """A packed bucket of the broadcast transport: same-dtype tensors laid end to end."""

    dtype: str
    """dtype of every tensor in the bucket."""
    tensors: tuple[TensorSpec, ...]
    """The tensors, in the order they are packed."""
    nbytes: int
    """Size of the packed buffer."""
    checksum: int
    """Checksum of the packed buffer."""


@dataclass(frozen=True)
class BucketDelta:
    """What of one bucket a delta update sends (:mod:`~torchrl_vllm_ext.weight_sync.delta`):
    the values of the tensors sent whole, then those of the changed positions of the others;
    the bucket's other bytes are the base version's."""

    dense: tuple[tuple[int, int], ...]
    """``(first element, elements)`` of each tensor sent whole, in bucket order."""
    positions: int
    """Changed elements sent one by one (after the dense values, their positions follow)."""
    index_dtype: str = "int32"
    """dtype of the positions (``int64`` for a bucket of 2**31 elements or more)."""


@dataclass(frozen=True)
class UpdateHeader:
    """The one control message of a broadcast update; buckets follow as collectives."""

    version: str
    """Weight version the update installs."""
    buckets: tuple[BucketSpec, ...]
    """Bucket layout, in broadcast order (their checksums: of the whole new bucket, a delta
    update's too)."""
    checksums_follow: bool = False
    """The buckets' checksums are not known when the header is sent (a sharded trainer
    gathers bucket by bucket): one more broadcast after the buckets carries them, as int64."""
    base: str = ""
    """A delta update: the version whose buckets it changes ('' : a full update)."""
    deltas: tuple[BucketDelta, ...] = ()
    """A delta update: what each bucket sends (one payload per bucket that sends any)."""


@dataclass(frozen=True)
class WorkerPayload:
    """What one worker of a per-worker update receives: its slices of the buckets, packed
    end to end (:mod:`~torchrl_vllm_ext.weight_sync.transports.broadcast.per_worker`)."""

    nbytes: int
    """Bytes of the payload."""
    checksum: int
    """Checksum of the payload (as :attr:`BucketSpec.checksum`)."""
    runs_digest: str
    """Digest of the element runs (the ones the worker reported) the payload was cut by."""


@dataclass(frozen=True)
class PerWorkerUpdate:
    """A broadcast update sent to each worker point to point: only what it keeps."""

    header: UpdateHeader
    """The buckets the payloads were cut from (the worker's receive buffers hold them)."""
    workers: tuple[WorkerPayload, ...]
    """Each worker's payload, by its rank in its replica."""


@dataclass(frozen=True)
class SlotManifest:
    """What a published storage slot holds; written atomically as ``current.json``."""

    version: str
    """Weight version in the slot."""
    slot: str
    """Slot directory name ("A" or "B")."""
    tensors: tuple[TensorSpec, ...]
    """Every tensor of the slot, with its checksum."""


@dataclass(frozen=True)
class SlotTarget:
    """A storage slot reserved for writers in other processes (a sharded trainer's ranks):
    allocated, not published."""

    slot: str
    """Slot directory name ("A" or "B"): the manifest that publishes it names it."""
    path: str
    """The slot's directory, which each writer maps (``slots.open_slot``)."""


@dataclass(frozen=True)
class CudaIpcHandle:
    """A CUDA allocation shared with another process on the same GPU: the fields of torch's
    ``reduce_tensor`` for a 1-D uint8 tensor, as plain data (bytes as base64), and the
    GPU by UUID (each process numbers its devices its own way)."""

    gpu: str
    """Normalised UUID of the GPU holding the bytes (:func:`~torchrl_vllm_ext.weight_sync.transports.devices.normalise_uuid`)."""
    numel: int
    """Bytes of the shared tensor."""
    offset: int
    """The tensor's offset in its storage (elements = bytes)."""
    storage_cls: str
    """torch storage class, by name (only torch's own are rebuilt)."""
    storage_handle: str
    """cudaIpcMemHandle of the storage's allocation, base64."""
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: str
    """Shared-memory ref counter that keeps the sender's allocation alive, base64."""
    ref_counter_offset: int
    event_handle: str
    """cudaIpcEventHandle the receiver waits on before reading, base64 ('' : none)."""
    event_sync_required: bool


@dataclass(frozen=True)
class IpcUpdate:
    """One CUDA IPC update: the packed buckets' layout and a handle per bucket."""

    header: UpdateHeader
    handles: tuple[CudaIpcHandle, ...]


def to_json(spec) -> str:
    """The JSON text of a spec.

    Examples:
        >>> from_json(to_json(TensorSpec("w", "float32", (2, 3), 7)), TensorSpec)
        TensorSpec(name='w', dtype='float32', shape=(2, 3), checksum=7)
    """
    return msgspec.json.encode(spec).decode()


def from_json(text: str | bytes, cls: type[T]) -> T:
    """The ``cls`` spec ``text`` encodes; a ``ValueError`` (msgspec's ``DecodeError``) naming
    the bad field when it is not one.

    Examples:
        >>> from_json('{"version": "3", "slot": "A"}', SlotManifest)
        Traceback (most recent call last):
        ...
        msgspec.ValidationError: Object missing required field `tensors`
    """
    return msgspec.json.decode(text, type=cls)


__all__ = [
    "BucketDelta",
    "BucketSpec",
    "CudaIpcHandle",
    "IpcUpdate",
    "PerWorkerUpdate",
    "SlotManifest",
    "SlotTarget",
    "TensorSpec",
    "UpdateHeader",
    "WorkerPayload",
    "from_json",
    "to_json",
]
