"""HandlePool: the replicas as a service handle in another process sees them.

It answers what :class:`~torchrl_vllm_ext.engine.driver.generation.Generation` and the service's control calls ask of
a :class:`~torchrl_vllm_ext.engine.driver.pool.ReplicaPool` (the ready snapshot, ``call_all`` / ``call``, leases,
limits, the weight version), fed by the owner's :class:`~.directory.ReplicaTable`, which
a task on the handle's event loop keeps watching. It starts, stops and restarts nothing:
a replica it finds dead leaves its snapshot at once (the batch is retried on the others)
and is reported to the owner, whose pool applies the one death policy and publishes the
restarted replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from types import MappingProxyType

from torchrl_vllm_ext.engine.calls import ReplicaCalls
from torchrl_vllm_ext.engine.config import ServiceConfig
from torchrl_vllm_ext.engine.fleet import ReplicaState, ReplicaView
from torchrl_vllm_ext.engine.handles.directory import ReplicaTable
from torchrl_vllm_ext.engine.labels import held_refusal
from torchrl_vllm_ext.errors import (
    ConfigurationError,
    NoHealthyReplicaError,
    ReplicaDeadError,
    ServiceClosedError,
)
from torchrl_vllm_ext.messages import ReplicaDeath, ReplicaInfo

logger = logging.getLogger(__name__)

WATCH_S = 30.0  # the directory's long poll: how long one watch call may wait


class HandlePool(ReplicaCalls):
    """The owner's replicas, read from its directory.

    Args:
        config: the owner's configuration.
        directory: the owner's :class:`~.directory.ReplicaDirectory` actor.
        table: the table the owner published last (the handle starts from it).
    """

    def __init__(self, config: ServiceConfig, directory, table: ReplicaTable):
        self.config = config
        self.directory = directory
        self._table = table
        self._dead: set[str] = set()  # actors this handle found dead, until the owner says
        self._ready = table.ready
        self._inflight: dict[int, int] = {}
        self._death_listeners: list[Callable[[int], None]] = []
        self._adapter_listeners: list[Callable[[tuple], None]] = []
        self._changed: asyncio.Event | None = None
        self._watcher: asyncio.Task | None = None

    # ------------------------------------------------------------------ the table
    def start_watching(self) -> None:
        """Follow the owner's table (call on the handle's event loop)."""
        self._changed = asyncio.Event()
        self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while not self._table.closed:
            try:
                table = await self.directory.watch.remote(self._table.seq, WATCH_S)
            except Exception as e:  # the directory died with its owner
                logger.info("service handle: the owner's directory is gone (%s)", e)
                self.apply(ReplicaTable(self._table.seq + 1, closed=True))
                return
            if table is not None:
                self.apply(table)

    def apply(self, table: ReplicaTable) -> None:
        """Take the owner's newer table."""
        if table.seq <= self._table.seq:
            return
        self._table = table
        live = {v.process for v in table.ready}
        self._dead &= live  # an actor the owner still lists ready keeps its mark
        self._ready = tuple(v for v in table.ready if v.process not in self._dead)
        for listener in self._adapter_listeners:
            listener(table.adapters)
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)

    # ------------------------------------------------------------------ snapshot
    def ready(self) -> tuple[ReplicaView, ...]:
        return self._ready

    def states(self):
        return MappingProxyType({k: ReplicaState(v) for k, v in self._table.states.items()})

    def view(self, replica_id: int) -> ReplicaView:
        for view in self._ready:
            if view.replica_id == replica_id:
                return view
        raise ReplicaDeadError(
            f"replica {replica_id} is not ready (state: "
            f"{self._table.states.get(replica_id, 'unknown')}); ready replicas: "
            f"{[v.replica_id for v in self._ready]}."
        )

    def deaths(self) -> list[ReplicaDeath]:
        return list(self._table.deaths)

    @property
    def table(self) -> ReplicaTable:
        return self._table

    @property
    def weight_version(self) -> str:
        return self._table.weight_version

    @property
    def limits(self) -> ReplicaInfo | None:
        return self._table.limits

    @property
    def uses_gpu(self) -> bool:
        return self._table.uses_gpu

    @property
    def workers_per_replica(self) -> int:
        return self.config.tensor_parallel_size * self.config.pipeline_parallel_size

    def on_death(self, listener: Callable[[int], None]) -> None:
        self._death_listeners.append(listener)

    def on_adapters(self, listener: Callable[[tuple], None]) -> None:
        """Call ``listener(adapters)`` with the owner's live adapters at every table."""
        self._adapter_listeners.append(listener)

    @property
    def provider(self) -> None:
        return None  # the owner's scheme brings restarted replicas up

    def when_serving(self, hook) -> Callable[[], None]:
        raise ConfigurationError(
            "a WeightSyncScheme needs the service's owner (the process that launched it); "
            "this is a handle in another process: push from the owner, or through "
            "WeightSyncUpdater / vLLMUpdaterV2 / service.update_weights (forwarded to it)."
        )

    # ------------------------------------------------------------------ leases (calls: ReplicaCalls)
    @contextlib.asynccontextmanager
    async def lease(self, replica_id: int, n: int) -> AsyncIterator[None]:
        """Count ``n`` requests in flight on a replica (this handle's own load-aware routing)."""
        self._inflight[replica_id] = self._inflight.get(replica_id, 0) + n
        try:
            yield
        finally:
            self._inflight[replica_id] -= n

    def inflight(self, replica_id: int) -> int:
        return self._inflight.get(replica_id, 0)

    async def wait_ready(self) -> tuple[ReplicaView, ...]:
        """The ready replicas; waits for the owner to publish one when none is."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.startup_timeout
        while not self._ready:
            if self._table.closed:
                raise ServiceClosedError("the service was shut down by its owner.")
            held = held_refusal("(the owner's)", self.states(), self.weight_version)
            if held is not None:
                raise held
            if loop.time() > deadline:
                raise NoHealthyReplicaError(
                    f"no ready replica within {self.config.startup_timeout:.0f}s (owner's "
                    f"states: {self._table.states}); check the owner's replicas' logs."
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.config.ready_poll_interval)
        return self._ready

    # ------------------------------------------------------------------ deaths
    def _died(self, view: ReplicaView, error: BaseException, what: str) -> ReplicaDeadError:
        """Take the replica out of this handle's snapshot and tell the owner."""
        actor = view.process
        cause = f"{type(error).__name__}: {error}"
        if actor not in self._dead:
            self._dead.add(actor)
            self._ready = tuple(v for v in self._ready if v.process != actor)
            for listener in self._death_listeners:
                listener(view.replica_id)
            logger.warning("replica %d died during %s (%s)", view.replica_id, what, cause)
            report = (view.replica_id, actor, cause, what)
            self.directory.submit.remote(
                "death", report, reply=False
            )  # the owner's pool restarts it
        return ReplicaDeadError(
            f"replica {view.replica_id} died during {what} ({cause}); the service's owner "
            "restarts it."
        )


__all__ = ["HandlePool"]
