"""The start order of replicas sharing a GPU: the first profiles alone, the others then
start together with the KV-cache size it measured pinned, and restarts reuse that size.

vLLM sizes an engine's KV cache from a profile of the GPU's memory: the free memory before
and after a dummy forward pass, the difference counted as its own. Two engines profiling
one GPU at once count each other's allocations (vLLM #55827: the second fails "No
available memory for the cache blocks"). Only that window needs the GPU alone; the rest of
a start (compile, KV allocation, CUDA-graph capture) does not. So, per GPU:

1. the first replica starts alone and reports its KV-cache size as soon as its engine
   logs it (after the profile, before graph capture: ``VLLMReplica.kv_cache_size``);
2. then every replica waiting on that GPU starts at once, each given that size as its own
   ``kv_cache_memory_bytes`` (vLLM skips the sizing; no profile to disturb);
3. a replica (re)started on that GPU later starts at once with the same size.

Memory bound: the first engine's size is what fits in its share (``gpu_memory_utilization``
of the GPU: weights, the profile's activation peak, non-torch memory and, from vLLM 0.21,
the CUDA graphs' estimated pool are subtracted first). Every replica on the GPU has the same
share, model and engine arguments, so a pinned one peaks within its share too: during its
own profile it holds weights and activations only, after it the same KV cache and graphs
as the first. Shares sum to at most 0.9 of a GPU (Ray's fractional ``gpus_per_replica``,
``ServiceConfig`` refuses a larger ``gpu_memory_utilization``), and vLLM itself refuses to
start an engine whose share is not free.

When no size is logged (vLLM's logging switched off, the first start failed), the next
replica on the GPU profiles alone in turn: one at a time, as before this order existed.
A size given by the user (``kv_cache_memory_bytes`` in the engine arguments) needs no
order: every replica starts at once.

:class:`StartOrder` is the plain state (which GPU has a size, who profiles), tested without
Ray; :class:`StartGates` awaits turns on the pool's event loop.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

GpuKey = tuple[str, str]
"""``(node, devices)``: :func:`~torchrl_vllm_ext.engine.driver.cluster.start_lock_key`."""
T = TypeVar("T")

WATCH_GRACE_S = 30.0
"""How long the size report may lag a start that ended (it polls a file)."""


class Role(enum.Enum):
    """How a replica starts on its GPU."""

    FREE = "free"
    """Nothing to order: it owns its GPU(s), or the user gave the KV-cache size."""
    PROFILE = "profile"
    """First on its GPU: vLLM sizes its KV cache from a profile, the others wait."""
    PINNED = "pinned"
    """Starts now, given the size the first replica on its GPU measured."""
    WAIT = "wait"
    """Another replica profiles its GPU: wait for the size."""


@dataclass(frozen=True)
class Pin:
    """A GPU's KV-cache size, as its first replica measured it."""

    nbytes: int
    """``kv_cache_memory_bytes`` every later replica on the GPU is given."""
    measured_by: int
    """The replica whose engine logged it."""
    after_s: float = 0.0
    """Seconds from the start of that replica's engine to the size (the GPU's gate)."""

    def __str__(self) -> str:
        return f"{self.nbytes} bytes ({self.nbytes / (1 << 30):.2f} GiB)"


@dataclass(frozen=True)
class Turn:
    """What a replica does now: its role, and the size it is given (PINNED)."""

    role: Role
    pin: Pin | None = None

    @property
    def kv_cache_memory_bytes(self) -> int | None:
        """The size the replica's engine is started with (None: vLLM sizes it)."""
        return self.pin.nbytes if self.pin is not None else None


def orders_starts(shares_gpus: bool, engine_kwargs: Mapping[str, Any]) -> bool:
    """Whether replica starts go through the order: they share GPUs and vLLM sizes their
    KV cache itself.

    Examples:
        >>> orders_starts(True, {"dtype": "bfloat16"})
        True
        >>> orders_starts(True, {"kv_cache_memory_bytes": 4 << 30})  # the user's size
        False
        >>> orders_starts(False, {})
        False
    """
    return shares_gpus and engine_kwargs.get("kv_cache_memory_bytes") is None


@dataclass
class StartOrder:
    """Per GPU: the pinned size, the replica profiling now, the replicas waiting.

    Plain state, changed on the pool's event loop only.

    Examples:
        >>> order = StartOrder()
        >>> gpu = ("10.0.0.2", "0")
        >>> order.turn(gpu, 0).role, order.turn(gpu, 1).role
        (<Role.PROFILE: 'profile'>, <Role.WAIT: 'wait'>)
        >>> order.measured(gpu, 0, 8 << 30, after_s=51.2)
        Pin(nbytes=8589934592, measured_by=0, after_s=51.2)
        >>> order.turn(gpu, 1).kv_cache_memory_bytes  # and a restart of 0 or 1 alike
        8589934592
    """

    pins: dict[GpuKey, Pin] = field(default_factory=dict)
    """The size each GPU's replicas are given (kept for restarts)."""
    profiling: dict[GpuKey, int] = field(default_factory=dict)
    """The replica profiling each GPU now."""
    waiting: dict[GpuKey, set[int]] = field(default_factory=dict)
    """Replicas waiting for a GPU's size."""

    def turn(self, key: GpuKey, replica_id: int) -> Turn:
        """What ``replica_id`` does on GPU ``key`` now (call again after each change)."""
        pin = self.pins.get(key)
        if pin is not None:
            self._not_waiting(key, replica_id)
            return Turn(Role.PINNED, pin)
        if self.profiling.get(key, replica_id) != replica_id:
            self.waiting.setdefault(key, set()).add(replica_id)
            return Turn(Role.WAIT)
        self._not_waiting(key, replica_id)
        self.profiling[key] = replica_id
        return Turn(Role.PROFILE)

    def measured(
        self, key: GpuKey, replica_id: int, nbytes: int | None, after_s: float = 0.0
    ) -> Pin | None:
        """The profile of ``replica_id`` on ``key`` is over, with the size its engine
        logged ``after_s`` into its start (None: none known). Its GPU opens either way;
        the pin, if any, is returned."""
        if self.profiling.get(key) == replica_id:
            del self.profiling[key]
        if nbytes is not None and nbytes > 0 and key not in self.pins:
            self.pins[key] = Pin(int(nbytes), replica_id, round(after_s, 1))
        return self.pins.get(key)

    def left(self, key: GpuKey, replica_id: int) -> None:
        """``replica_id`` stopped waiting (its start was cancelled)."""
        self._not_waiting(key, replica_id)

    def _not_waiting(self, key: GpuKey, replica_id: int) -> None:
        waiting = self.waiting.get(key)
        if waiting is not None:
            waiting.discard(replica_id)
            if not waiting:
                del self.waiting[key]


class StartGates:
    """:class:`StartOrder` on an event loop: each replica's engine start awaits its turn.

    Args:
        order: the state (a fresh one by default).

    Examples:
        >>> gates = StartGates()
        >>> gates.order.pins
        {}
    """

    def __init__(self, order: StartOrder | None = None):
        self.order = order if order is not None else StartOrder()
        self._changed: asyncio.Condition | None = None  # made on the loop that uses it

    async def start(
        self,
        key: GpuKey,
        replica_id: int,
        start: Callable[[int | None, bool], Awaitable[T]],
        watch: Callable[[], Awaitable[int | None]],
        prepare: Callable[[], Awaitable[Any]] | None = None,
    ) -> T:
        """Start replica ``replica_id`` on GPU ``key`` in its turn.

        Args:
            key: its GPU.
            replica_id: the replica.
            start: ``start(kv_cache_memory_bytes, report_size)`` starts its engine (with
                that size, or sized by vLLM) and returns once it serves.
            watch: awaits the size its starting engine logs (None: the start ended
                without one); awaited beside ``start`` when it profiles.
            prepare: what it may do while it waits (import vLLM).

        Returns:
            What ``start`` returned.
        """
        turn = self.order.turn(key, replica_id)
        if turn.role is Role.WAIT:
            await self._wait(key, replica_id, prepare)
            turn = self.order.turn(key, replica_id)
        if turn.role is Role.PINNED:
            logger.info(
                "replica %d starts on GPU %s with kv_cache_memory_bytes=%s, measured by replica %d",
                replica_id,
                _gpu(key),
                turn.pin,
                turn.pin.measured_by,
            )
            return await start(turn.kv_cache_memory_bytes, False)
        return await self._profile(key, replica_id, start, watch)

    async def _wait(self, key, replica_id, prepare) -> None:
        logger.info(
            "replica %d waits: replica %d profiles GPU %s's memory alone",
            replica_id,
            self.order.profiling[key],
            _gpu(key),
        )
        changed = self._condition()
        preparing = asyncio.ensure_future(prepare()) if prepare is not None else None
        try:
            async with changed:
                while self.order.turn(key, replica_id).role is Role.WAIT:
                    await changed.wait()
            if preparing is not None:
                await preparing
        except BaseException:
            self.order.left(key, replica_id)
            if preparing is not None:
                preparing.cancel()
            raise

    async def _profile(self, key, replica_id, start, watch):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        logger.info(
            "replica %d profiles GPU %s's memory alone; replicas sharing it wait for its "
            "KV-cache size",
            replica_id,
            _gpu(key),
        )
        starting = asyncio.ensure_future(start(None, True))
        watching = asyncio.ensure_future(watch())
        nbytes = None
        try:
            await asyncio.wait({starting, watching}, return_when=asyncio.FIRST_COMPLETED)
            if not watching.done():  # the start ended first: the report follows within a poll
                await asyncio.wait({watching}, timeout=WATCH_GRACE_S)
            if watching.done() and not watching.cancelled() and watching.exception() is None:
                nbytes = watching.result()
            elif watching.done() and not watching.cancelled():
                logger.debug("replica %d reported no KV-cache size", replica_id, exc_info=True)
        except BaseException:
            starting.cancel()
            raise
        finally:
            watching.cancel()
            waiting = sorted(self.order.waiting.get(key, ()))
            pin = self.order.measured(key, replica_id, nbytes, loop.time() - t0)
            await self._notify()
            if pin is not None and pin.measured_by == replica_id:
                logger.info(
                    "replica %d sized its KV cache on GPU %s to %s after %.1f s; replicas %s "
                    "start now, each pinned to it",
                    replica_id,
                    _gpu(key),
                    pin,
                    pin.after_s,
                    waiting,
                )
            elif waiting and starting.done() and not starting.cancelled():
                failed = starting.exception() is not None  # raised below, to the caller
                logger.warning(
                    "replica %d's start on GPU %s %s; replicas %s profile the GPU one at a time",
                    replica_id,
                    _gpu(key),
                    "failed"
                    if failed
                    else "ended without vLLM logging its KV-cache size (vLLM's logging off: "
                    "VLLM_CONFIGURE_LOGGING=0?)",
                    waiting,
                )
        return await starting

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self) -> None:
        changed = self._condition()
        async with changed:
            changed.notify_all()


def _gpu(key: GpuKey) -> str:
    node, devices = key
    return f"{devices}@{node}"


__all__ = ["GpuKey", "Pin", "Role", "StartGates", "StartOrder", "Turn", "orders_starts"]
