"""The broadcast transport, trainer side: packed buckets over a stateless process group.

One update = one header (names, dtypes, shapes, bucket layout, checksums, version)
sent to each replica, then one collective per bucket; never one RPC per tensor.
NCCL on CUDA, gloo on CPU: only the process-group class differs
(:func:`~torchrl_vllm_ext.weight_sync.worker.make_process_group`).
"""

from __future__ import annotations

import socket

import torch

from torchrl_vllm_ext.messages import BucketSpec, TensorSpec, UpdateHeader
from torchrl_vllm_ext.weight_sync.params import checksum, dtype_name
from torchrl_vllm_ext.weight_sync.worker import make_process_group

DEFAULT_BUCKET_BYTES = 256 << 20


def pack(
    tensors: dict[str, torch.Tensor], version: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> tuple[UpdateHeader, list[torch.Tensor]]:
    """Pack same-dtype tensors end to end into buckets of about ``bucket_bytes``.

    Returns the header and the uint8 buffers, in broadcast order. A tensor larger
    than ``bucket_bytes`` gets a bucket of its own.
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
                checksum=checksum(buf.cpu()),
            )
        )
        buffers.append(buf)
    return UpdateHeader(version=str(version), buckets=tuple(specs)), buffers


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BroadcastGroup:
    """Rank 0 (the trainer) of a group with every replica worker; blocks until all joined.

    ``listener`` is the socket the rendezvous store serves on (from
    :func:`~torchrl_vllm_ext.weight_sync.worker.listen`, bound to ``host`` only; the
    store takes it over); without one, ``host:port`` is bound here.
    """

    def __init__(
        self,
        backend: str,
        host: str,
        port: int,
        world_size: int,
        timeout_s: float,
        listener: socket.socket | None = None,
    ):
        self.backend = backend
        self.world_size = world_size
        self._store, self._pg = make_process_group(
            backend, host, port, world_size, 0, timeout_s, listener
        )

    def send(self, buffers: list[torch.Tensor]) -> None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )
        for buf in buffers:
            self._pg.broadcast(buf.to(device), 0).wait()

    def close(self) -> None:
        self._pg = None
        self._store = None
