"""What the clients of a service's replicas share, in every process: the states of a
replica, the immutable view of a ready one, and the two narrow protocols through which
weight sync meets the pool (:class:`ReplicaFleet`: what a transport sees;
:class:`WeightsProvider`: what brings a restarted replica to the live weights).

The owner's :class:`~torchrl_vllm_ext.engine.driver.pool.ReplicaPool` and a handle's
:class:`~torchrl_vllm_ext.engine.handles.pool.HandlePool` both hand out these views.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from torchrl_vllm_ext.engine.calls import Outcomes
from torchrl_vllm_ext.messages import ReplicaInfo


class ReplicaState(enum.Enum):
    """Where a replica is in its life: ``STARTING -> (READY | HELD) -> (DRAINING | DEAD ->
    STARTING) -> STOPPED``; ``HELD -> READY`` once a push brings it to the live version."""

    STARTING = "starting"
    """Placed, engine starting, or being brought to the live weights and adapters."""
    READY = "ready"
    """Takes traffic."""
    HELD = "held"
    """Started, but holds other weights than the live version's (the checkpoint's, when no
    weight-sync scheme could bring it up): takes no traffic until a push does
    (:mod:`~torchrl_vllm_ext.engine.labels`)."""
    DRAINING = "draining"
    """Takes no new work; stops once idle (``remove_replicas``)."""
    DEAD = "dead"
    """Noticed dead; a restart is under way."""
    STOPPED = "stopped"
    """Released."""


@dataclass(frozen=True)
class ReplicaView:
    """A started replica as the pool's clients see it (immutable: safe on any thread)."""

    replica_id: int
    """Stable id within the service (a restart keeps it)."""
    handle: Any
    """The Ray actor handle (:class:`~torchrl_vllm_ext.engine.replica.actor.VLLMReplica`)."""
    info: ReplicaInfo
    """What the replica reported once its engine was up (pid, node, limits)."""

    @property
    def node(self) -> str:
        """The Ray node IP the replica runs on."""
        return self.info.node_ip

    @property
    def process(self) -> str:
        """The actor process serving it (``node:pid``): a restarted replica is another."""
        return f"{self.info.node_ip}:{self.info.pid}"


class WeightsProvider(Protocol):
    """What brings a (re)started replica to the live weights (a weight-sync scheme).

    The pool holds at most one and awaits :meth:`bring_up` on its event loop before a
    started replica takes traffic.
    """

    version: str | None
    """The version the provider last pushed (None: nothing pushed yet)."""

    async def bring_up(self, replica: ReplicaView) -> str | None:
        """Load ``version`` into ``replica`` and label it; returns the version loaded (None:
        it loaded nothing, and the replica still holds the checkpoint)."""


class ReplicaFleet(Protocol):
    """What a weight-sync transport sees of the service: the ready replicas and one way to
    call them (with the pool's death policy)."""

    @property
    def uses_gpu(self) -> bool: ...

    @property
    def workers_per_replica(self) -> int: ...

    def ready(self) -> tuple[ReplicaView, ...]: ...

    async def call_all(
        self,
        method: str,
        *args: Any,
        replicas: Iterable[ReplicaView] | None = None,
        timeout: float | None = None,
        deadline: float | None = None,
    ) -> Outcomes: ...

    async def call_each(
        self,
        call: Callable[[ReplicaView], Awaitable[Any]],
        replicas: Iterable[ReplicaView] | None = None,
        what: str = "call",
        timeout: float | None = None,
        deadline: float | None = None,
    ) -> Outcomes: ...


class PushFleet(ReplicaFleet, Protocol):
    """What a weight-sync scheme sees of the service's replicas: the transports' view, and
    what a push needs besides: the live version, the restart of a replica it cannot trust
    (it serves weights nobody pushed), a hook for when the service serves again (a deferred value
    check), and the provider that brings restarted replicas to the live weights."""

    weight_version: str
    provider: WeightsProvider | None

    def restart_untrusted(self, view: ReplicaView, error: BaseException, what: str) -> None: ...

    def when_serving(
        self, hook: Callable[[tuple[ReplicaView, ...]], Awaitable[Any]]
    ) -> Callable[[], None]: ...

    def set_provider(self, provider: WeightsProvider | None) -> None: ...
