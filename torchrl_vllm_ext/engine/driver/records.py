"""ReplicaRecords: the pool's mutable record of each replica, and the two immutable
snapshots any thread may read.

One writer, many readers: records change on the service's event loop only; after every
change :meth:`ReplicaRecords.publish` replaces the ready snapshot (a tuple of
:class:`~torchrl_vllm_ext.engine.fleet.ReplicaView`) and the states (a read-only mapping)
with one assignment each, so a reader on another thread sees the old or the new one,
never half of a change. The records also count the requests in flight on each replica
(leases: load-aware routing reads them, draining waits for zero).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torchrl_vllm_ext.engine.fleet import ReplicaState, ReplicaView
from torchrl_vllm_ext.errors import ReplicaDeadError
from torchrl_vllm_ext.messages import ReplicaInfo


@dataclass
class Record:
    """A replica's mutable record (touched on the event loop only)."""

    replica_id: int
    pg: Any
    node: str | None = None  # planned, then the node it reported
    actor: Any = None
    info: ReplicaInfo | None = None
    state: ReplicaState = ReplicaState.STARTING
    inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    holds: str | None = None  # the version a started replica loaded (None: the checkpoint)

    def __post_init__(self):
        self.idle.set()

    def view(self) -> ReplicaView:
        return ReplicaView(self.replica_id, self.actor, self.info)


class ReplicaRecords:
    """Every replica the pool holds, by id, and the snapshots published from them.

    Examples:
        >>> records = ReplicaRecords()
        >>> rec = records.add(Record(replica_id=0, pg=None))
        >>> dict(records.states()), records.ready()
        ({0: <ReplicaState.STARTING: 'starting'>}, ())
    """

    def __init__(self):
        self._records: dict[int, Record] = {}
        self._ready: tuple[ReplicaView, ...] = ()
        self._states: Mapping[int, ReplicaState] = MappingProxyType({})
        self._listeners: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ snapshots (any thread)
    def ready(self) -> tuple[ReplicaView, ...]:
        """The ready replicas, by id; an immutable snapshot any thread may read."""
        return self._ready

    def states(self) -> Mapping[int, ReplicaState]:
        """Every replica held and its state; an immutable snapshot."""
        return self._states

    def view(self, replica_id: int) -> ReplicaView:
        """The ready replica ``replica_id``; :class:`ReplicaDeadError` if it is not ready."""
        for view in self._ready:
            if view.replica_id == replica_id:
                return view
        state = self._states.get(replica_id)
        raise ReplicaDeadError(
            f"replica {replica_id} is not ready (state: "
            f"{state.value if state else 'unknown'}); ready replicas: "
            f"{[v.replica_id for v in self._ready]}."
        )

    # ------------------------------------------------------------------ records (the loop)
    def add(self, rec: Record) -> Record:
        """Hold ``rec`` (a new replica, or a restart under the same id) and publish."""
        self._records[rec.replica_id] = rec
        self.publish()
        return rec

    def get(self, replica_id: int) -> Record | None:
        return self._records.get(replica_id)

    def all(self) -> list[Record]:
        """Every record, by id (a copy: the caller may change the records meanwhile)."""
        return [self._records[rid] for rid in sorted(self._records)]

    def forget(self, rec: Record) -> None:
        """Drop ``rec`` if it is still the record of its id (a restart may have replaced
        it), and publish."""
        if self._records.get(rec.replica_id) is rec:
            del self._records[rec.replica_id]
        self.publish()

    def set_state(self, rec: Record, state: ReplicaState) -> None:
        rec.state = state
        self.publish()

    def temp_dirs(self) -> list[str]:
        """The temporary directories of the replicas held (for an exit after Ray was shut
        down under the service: see ``VLLMService``'s exit hook)."""
        return [r.info.temp_dir for r in self.all() if r.info is not None and r.info.temp_dir]

    def nodes_in_use(self) -> Counter:
        """How many live replicas each node holds (the placement's ``ours``)."""
        gone = (ReplicaState.DEAD, ReplicaState.STOPPED)
        return Counter(r.node for r in self._records.values() if r.node and r.state not in gone)

    def on_publish(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (on the loop) after every :meth:`publish`."""
        self._listeners.append(listener)

    def publish(self) -> None:
        """Replace the snapshots (one assignment each: readers see the old or the new) and
        tell the listeners (the service mirrors them to its handles' directory)."""
        recs = self.all()
        self._ready = tuple(r.view() for r in recs if r.state is ReplicaState.READY)
        self._states = MappingProxyType({r.replica_id: r.state for r in recs})
        for listener in self._listeners:
            listener()

    # ------------------------------------------------------------------ leases
    @contextlib.asynccontextmanager
    async def lease(self, replica_id: int, n: int) -> AsyncIterator[None]:
        """Count ``n`` requests in flight on a replica while the block runs (load-aware
        routing reads the count; draining waits for it to reach zero)."""
        rec = self._records.get(replica_id)
        if rec is None:
            raise ReplicaDeadError(f"replica {replica_id} was stopped; it takes no requests.")
        rec.inflight += n
        rec.idle.clear()
        try:
            yield
        finally:
            rec.inflight -= n
            if rec.inflight == 0:
                rec.idle.set()

    def inflight(self, replica_id: int) -> int:
        rec = self._records.get(replica_id)
        return rec.inflight if rec is not None else 0


__all__ = ["Record", "ReplicaRecords"]
