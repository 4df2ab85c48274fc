"""A process group of the trainer and every replica worker, outside torch.distributed's
global state: the broadcast transport's wire.

NCCL on CUDA, gloo on CPU: only the process-group class differs
(:func:`make_process_group`), so the CPU tests cover the rest of the path.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.listening import gloo_options, listen, serve_store

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JoinedGroup:
    """A process group and the rendezvous store it was made over (rank 0's store serves
    the others: it lives as long as the group)."""

    store: Any
    """The ``torch.distributed.TCPStore``."""
    process_group: Any
    """The ``ProcessGroupNCCL`` / ``ProcessGroupGloo`` its collectives run on."""


def make_process_group(
    backend: str,
    host: str,
    port: int,
    world_size: int,
    rank: int,
    timeout_s: float,
    listener: socket.socket | None = None,
) -> JoinedGroup:
    """A process group outside torch.distributed's global state (the worker has its own).

    Rank 0 serves the rendezvous store on ``listener``, a socket bound to ``host``
    (bound here when not given), which the store takes over; gloo's pairs listen on
    ``host`` when it is the loopback (:mod:`torchrl_vllm_ext.listening`). The only
    difference between the GPU and CPU paths is the backend class.
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        if listener is None:
            listener = listen(host, port)
        store = serve_store(
            host, timeout, world_size=world_size, wait_for_workers=True, listener=listener
        )
    else:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout  # the push's deadline, not torch's 10-minute default
        pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
    elif backend == "gloo":
        pg = dist.ProcessGroupGloo(store, rank, world_size, gloo_options(host, timeout))
    else:
        raise WeightSyncError(
            f"broadcast backend {backend!r} is not supported; use 'gloo' or 'nccl'."
        )
    return JoinedGroup(store, pg)


def end_group(backend: str, pg) -> None:
    """Let a process group go. An NCCL group is aborted: NCCL's ``wait`` does not block
    the host, so when a member dies the others' receive kernels spin on their GPUs until
    the watchdog's timeout, which then tears the whole process (a vLLM worker) down;
    aborting ends them now (the receive fails its checksums) and frees the communicator.
    A gloo group goes with its last reference."""
    if backend == "nccl" and pg is not None:
        try:
            pg.abort()
        except Exception:  # already torn down: nothing left to free
            logger.debug("aborting the NCCL weight-broadcast group failed", exc_info=True)


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
        self.port = port  # where rank 0's rendezvous store listens
        self._joined: JoinedGroup | None = make_process_group(
            backend, host, port, world_size, 0, timeout_s, listener
        )

    def send(self, buffers: list[torch.Tensor]) -> None:
        for buf in buffers:
            self._joined.process_group.broadcast(buf.to(self._device(buf)), 0).wait()
            del buf  # a streamed bucket is freed before the next one is asked for

    def send_each(self, sends: list[tuple[int, torch.Tensor]]) -> None:
        """Send each ``(rank, payload)`` to that rank alone (per-worker sends: gloo)."""
        pg = self._joined.process_group
        # Every send in flight at once (each to another rank), then waited for.
        works = [
            pg.send([payload.to(self._device(payload))], rank, 0)
            for rank, payload in sends
            if payload.numel()  # it keeps nothing: nothing is sent (nor received)
        ]
        for work in works:
            work.wait()

    def _device(self, buf: torch.Tensor) -> torch.device:
        """Where rank 0 sends from: gloo from the host; NCCL from the GPU the buckets were
        packed on (the trainer's, which the transport plan kept out of the group's other
        ranks), else the current one."""
        if self.backend != "nccl":
            return torch.device("cpu")
        return buf.device if buf.is_cuda else torch.device("cuda", torch.cuda.current_device())

    def close(self) -> None:
        joined, self._joined = self._joined, None
        if joined is not None:
            end_group(self.backend, joined.process_group)
