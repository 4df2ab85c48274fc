"""The replica directory: how a service's handles in other processes see its replicas and
reach its owner.

A pickled :class:`~torchrl_vllm_ext.VLLMService` is a handle (TorchRL ships its policy
into Ray actors). The owner's pool publishes a :class:`ReplicaTable` (the ready replicas'
Ray actor handles, their states, the weight version, the deaths, the adapters) to one
small Ray actor, :class:`ReplicaDirectory`, after every change; handles watch it.

What a handle may not do itself goes to the owner through the directory's mailbox as
plain requests (``kind``, payload): a death it found (the owner's pool applies its one
death policy) and the owner-only calls it forwards (a push, a pause, ...).
:class:`Mailbox` is the owner's side: threads that take requests and answer them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray

from torchrl_vllm_ext.engine.adapters import Adapter
from torchrl_vllm_ext.errors import ServiceClosedError, TorchRLVLLMError
from torchrl_vllm_ext.messages import ReplicaDeath, ReplicaInfo

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaTable:
    """What the owner's pool publishes: one consistent state of the service."""

    seq: int
    """Increases with every publication (a handle keeps the newest it saw)."""
    ready: tuple = ()
    """The ready replicas (:class:`~torchrl_vllm_ext.engine.fleet.ReplicaView`: id, Ray actor handle, info)."""
    states: dict[int, str] = field(default_factory=dict)
    """Every replica the owner holds and its state (``ready``, ``dead``, ...)."""
    weight_version: str = "0"
    """The version every replica serves."""
    deaths: tuple[ReplicaDeath, ...] = ()
    """Every death the owner's pool recorded, oldest first."""
    limits: ReplicaInfo | None = None
    """The first replica's limits."""
    adapters: tuple[Adapter, ...] = ()
    """The live LoRA adapters."""
    uses_gpu: bool = False
    """Whether the replicas run on GPUs."""
    closed: bool = False
    """The owner shut the service down."""


class ReplicaDirectory:
    """Ray actor body (async): the latest :class:`ReplicaTable` and the owner's mailbox."""

    def __init__(self):
        self._table = ReplicaTable(seq=-1)
        self._changed = asyncio.Condition()
        self._ids = itertools.count()
        self._requests: asyncio.Queue = asyncio.Queue()
        self._answers: dict[int, asyncio.Future] = {}

    async def publish(self, table: ReplicaTable) -> None:
        async with self._changed:
            if table.seq > self._table.seq:
                self._table = table
                self._changed.notify_all()

    async def watch(self, seen: int, timeout: float) -> ReplicaTable | None:
        """The table once it is newer than ``seen``; None if ``timeout`` passed first."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self._table.seq > seen), timeout
                )
            except TimeoutError:
                return None
            return self._table

    async def submit(self, kind: str, payload: Any, reply: bool = True) -> int:
        """Queue a request for the owner; its id (for :meth:`result`, when ``reply``)."""
        if self._table.closed:
            raise ServiceClosedError("the service was shut down by its owner.")
        rid = next(self._ids)
        if reply:
            self._answers[rid] = asyncio.get_running_loop().create_future()
        await self._requests.put((rid, kind, payload))
        return rid

    async def take(self, timeout: float) -> list[tuple[int, str, Any]]:
        """The owner's long poll: the queued requests (waits up to ``timeout`` for one)."""
        try:
            first = await asyncio.wait_for(self._requests.get(), timeout)
        except TimeoutError:
            return []
        taken = [first]
        while not self._requests.empty():
            taken.append(self._requests.get_nowait())
        return taken

    async def answer(self, rid: int, ok: bool, value: Any) -> None:
        fut = self._answers.get(rid)
        if fut is not None and not fut.done():
            fut.set_result((ok, value))

    async def result(self, rid: int) -> tuple[Any, ReplicaTable]:
        """Wait for the owner's answer to request ``rid``: its value (or its error), and
        the table then (what the call changed was published before the owner answered)."""
        ok, value = await self._answers[rid]
        del self._answers[rid]
        if not ok:
            raise value
        return value, self._table


def start_directory(name: str):
    """The directory actor of service ``name`` (no CPU reserved: it only forwards)."""
    return (
        ray.remote(ReplicaDirectory)
        .options(name=f"{name}-directory", num_cpus=0, max_concurrency=1000)
        .remote()
    )


class Mailbox:
    """The owner's side of the directory's mailbox: a thread takes requests and runs
    ``serve(kind, payload)`` for each in a small thread pool (a forwarded push may block
    for seconds; a death report meanwhile must not wait), then answers.

    Args:
        directory: the directory actor.
        serve: the owner's handler; what it returns or raises is the answer.
    """

    def __init__(self, directory, serve: Callable[[str, Any], Any], name: str):
        self._directory = directory
        self._serve = serve
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(4, thread_name_prefix=f"{name}-mailbox")
        self._thread = threading.Thread(target=self._run, name=f"{name}-mailbox", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                requests = ray.get(self._directory.take.remote(0.5))
            except Exception as e:  # the directory is gone: the service is closing
                if not self._stop.is_set():
                    logger.warning("service mailbox stopped: %s", e)
                return
            for request in requests:
                self._pool.submit(self._one, *request)

    def _one(self, rid: int, kind: str, payload: Any) -> None:
        try:
            ok, value = True, self._serve(kind, payload)
        except Exception as e:
            ok, value = False, e if isinstance(e, TorchRLVLLMError) else _plain_error(e)
        try:
            self._directory.answer.remote(rid, ok, value)
        except Exception as e:
            logger.debug("could not answer request %d: %s", rid, e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)


def _plain_error(error: Exception) -> Exception:
    """``error`` as it crosses back to a handle (its type if it pickles, else its text)."""
    try:
        import pickle

        pickle.dumps(error)
        return error
    except Exception:
        return TorchRLVLLMError(f"{type(error).__name__}: {error}")


__all__ = ["Mailbox", "ReplicaDirectory", "ReplicaTable", "start_directory"]
