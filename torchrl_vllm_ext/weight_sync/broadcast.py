"""The broadcast transport, trainer side: packed buckets over a stateless process group.

One update = one header (names, dtypes, shapes, bucket layout, checksums, version)
sent to each replica, then one collective per bucket; never one RPC per tensor.
NCCL on CUDA, gloo on CPU: only the process-group class differs
(:func:`make_process_group`). The receiving end is the worker extension
(:mod:`torchrl_vllm_ext.weight_sync.worker`).
"""

from __future__ import annotations

import json
import socket
from dataclasses import asdict
from datetime import timedelta

import torch

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.messages import BucketSpec, TensorSpec, UpdateHeader
from torchrl_vllm_ext.weight_sync.params import checksum, dtype_name, torch_dtype

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


def header_to_json(h: UpdateHeader) -> str:
    return json.dumps(asdict(h))


def header_from_json(text: str) -> UpdateHeader:
    raw = json.loads(text)
    buckets = tuple(
        BucketSpec(
            dtype=b["dtype"],
            tensors=tuple(
                TensorSpec(t["name"], t["dtype"], tuple(t["shape"]), int(t["checksum"]))
                for t in b["tensors"]
            ),
            nbytes=int(b["nbytes"]),
            checksum=int(b["checksum"]),
        )
        for b in raw["buckets"]
    )
    return UpdateHeader(version=str(raw["version"]), buckets=buckets)


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


def make_process_group(
    backend: str,
    host: str,
    port: int,
    world_size: int,
    rank: int,
    timeout_s: float,
    listener: socket.socket | None = None,
):
    """A process group outside torch.distributed's global state (the worker has its own).

    Rank 0 serves the rendezvous store on ``listener``, a socket bound to ``host``
    (bound here when not given), which the store takes over. The only difference
    between the GPU and CPU paths is the backend class.
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        # NOTE: TCPStore alone listens on every interface; on a socket bound to ``host``
        # (loopback on one machine) the store is reachable from the group's hosts only.
        listener = listener if listener is not None else listen(host, port)
        # The store closes the descriptor when it goes: hand it over.
        fd = listener.detach()
        store = dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=fd)
    else:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if backend == "nccl":
        pg = dist.ProcessGroupNCCL(store, rank, world_size)
    elif backend == "gloo":
        pg = dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))
    else:
        raise WeightSyncError(
            f"broadcast backend {backend!r} is not supported; use 'gloo' or 'nccl'."
        )
    return store, pg


def listen(host: str, port: int = 0) -> socket.socket:
    """A listening TCP socket bound to ``host`` only (``port`` 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BroadcastGroup:
    """Rank 0 (the trainer) of a group with every replica worker; blocks until all joined.

    ``listener`` is the socket the rendezvous store serves on (from
    :func:`listen`, bound to ``host`` only; the
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
