"""The one list of weight-sync transports and routes: every other module, test and benchmark
reads names from here.

A **transport** is what a scheme is built with (``WeightSyncScheme(service, transport=...)``):
a sender (a :class:`~.protocol.Transport` in the trainer's process), a receiver held by the
one object each vLLM worker keeps (:class:`~torchrl_vllm_ext.weight_sync.worker.WorkerWeightSync`,
to which the worker extension's methods delegate), and optionally a part in the replica's
Ray actor. A **route** is how ``auto`` reaches one replica of a push: each route is
carried by one transport with its options (``nccl`` and ``gloo`` are the broadcast transport
with a backend each).

To add a transport: a folder ``transports/<name>/`` with ``sender.py`` (a ``Transport``) and
``receiver.py`` (built over the worker's :class:`~torchrl_vllm_ext.weight_sync.loading.loads.Loads`),
its worker methods declared in :mod:`torchrl_vllm_ext.extensions` and delegated to it in
:mod:`torchrl_vllm_ext.weight_sync.worker`, and one :class:`TransportInfo` below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchrl_vllm_ext.extensions import load_class

_PKG = "torchrl_vllm_ext.weight_sync.transports"


@dataclass(frozen=True)
class TransportInfo:
    """One transport: its name, what it serves, and where its parts live (dotted paths)."""

    name: str
    """What ``transport=`` takes and ``SyncReport.transport`` reports (``auto``: its routes)."""
    summary: str
    """One line for ``--help`` texts and docs."""
    sender: str
    """The :class:`~.protocol.Transport` subclass in the trainer's process."""
    receiver: str
    """Its receiver in each vLLM worker (a field of ``WorkerWeightSync``)."""
    actor: str | None = None
    """Its part in the replica's Ray actor, if any."""
    routes: tuple[str, ...] = ()
    """The routes of ``auto`` it carries (a key of :data:`ROUTES` each)."""
    needs_cuda: bool = False
    """Whether it needs the trainer's tensors and the replicas on CUDA GPUs."""
    cpu: bool = True
    """Whether CPU replicas can use it."""
    composite: bool = False
    """Whether it composes other transports (``auto``) rather than moving bytes itself."""
    deltas: bool = False
    """Whether it sends delta pushes (:mod:`~torchrl_vllm_ext.weight_sync.delta`)."""


@dataclass(frozen=True)
class RouteInfo:
    """One route of ``auto``: the transport that carries it and that transport's options."""

    name: str
    transport: str
    packed: bool
    """Whether it takes the push packed in buckets (shared by every packed route of a push)."""
    options: dict = field(default_factory=dict)


TRANSPORTS: dict[str, TransportInfo] = {
    t.name: t
    for t in (
        TransportInfo(
            "auto",
            "per push: storage or gloo on CPU replicas; on GPUs a route per replica by device",
            f"{_PKG}.auto.sender.PlannedTransport",
            f"{_PKG}.auto.receiver.PlanReceiver",
            composite=True,
        ),
        TransportInfo(
            "storage",
            "memory-mapped A/B TensorDict slots the workers load from (one host, or a shared "
            "directory)",
            f"{_PKG}.storage.sender.StorageTransport",
            f"{_PKG}.storage.receiver.StorageReceiver",
            actor=f"{_PKG}.storage.actor.StorageActor",
            routes=("storage",),
            deltas=True,
        ),
        TransportInfo(
            "broadcast",
            "packed buckets over a process group of the trainer and every worker (NCCL on GPUs, "
            "gloo on CPUs)",
            f"{_PKG}.broadcast.sender.BroadcastTransport",
            f"{_PKG}.broadcast.receiver.BroadcastReceiver",
            routes=("nccl", "gloo"),
            deltas=True,
        ),
        TransportInfo(
            "ipc",
            "CUDA IPC handles of the trainer's packed buckets, for replicas on its GPU",
            f"{_PKG}.ipc.sender.IpcTransport",
            f"{_PKG}.ipc.receiver.IpcReceiver",
            routes=("ipc",),
            needs_cuda=True,
            cpu=False,
        ),
    )
}

ROUTES: dict[str, RouteInfo] = {
    r.name: r
    for r in (
        RouteInfo("ipc", "ipc", packed=True),
        RouteInfo("nccl", "broadcast", packed=True, options={"backend": "nccl"}),
        RouteInfo("gloo", "broadcast", packed=True, options={"backend": "gloo"}),
        RouteInfo("storage", "storage", packed=False),
    )
}


def names(*, cpu: bool | None = None, composite: bool | None = None) -> tuple[str, ...]:
    """Transport names, those with ``cpu`` / ``composite`` as given (None: either).

    Examples:
        >>> names()
        ('auto', 'storage', 'broadcast', 'ipc')
        >>> names(cpu=True, composite=False)  # what CPU tests and check-model push with
        ('storage', 'broadcast')
    """
    return tuple(
        t.name
        for t in TRANSPORTS.values()
        if (cpu is None or t.cpu == cpu) and (composite is None or t.composite == composite)
    )


def delta_names() -> tuple[str, ...]:
    """The transports that send delta pushes.

    Examples:
        >>> delta_names()
        ('storage', 'broadcast')
    """
    return tuple(t.name for t in TRANSPORTS.values() if t.deltas)


def info(name: str) -> TransportInfo:
    """The transport registered as ``name``; a ``ValueError`` naming the others if none is."""
    if name not in TRANSPORTS:
        raise ValueError(f"transport={name!r} is not one of {names()}.")
    return TRANSPORTS[name]


def make_transport(name: str, fleet, options):
    """A new sender of transport ``name`` over ``fleet`` (``options``:
    :class:`~.protocol.TransportOptions`)."""
    return load_class(info(name).sender)(fleet, options)


def make_route(route: str, fleet, options):
    """A new sender for one route of ``auto`` (its transport with the route's options)."""
    from dataclasses import replace

    r = ROUTES[route]
    return make_transport(r.transport, fleet, replace(options, **r.options))


def actor_parts() -> tuple[type, ...]:
    """Every transport's part in the replica actor (the actor extension's bases)."""
    return tuple(load_class(t.actor) for t in TRANSPORTS.values() if t.actor)
