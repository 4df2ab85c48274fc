"""The transport protocol: how a push's bytes reach the replicas' workers. Closed: the
scheme and the composite ``auto`` call transports only through these steps.

A push (``WeightSyncScheme``) is: validate -> :meth:`Transport.prepare` (outside any pause:
write, send, stage; the replicas keep generating; it returns what it did, a
:class:`Prepared`) -> on each replica it reached, in its pause, the :class:`WorkerCall` it
returned for it -> :meth:`~Transport.commit` (or
:meth:`~Transport.rollback` when no replica loaded). :meth:`~Transport.connect` sets up
what every push uses before the first; :meth:`~Transport.bring_up` loads the committed
version into a restarted replica; :meth:`~Transport.close` releases everything. A push
that ``auto`` packed once for several routes hands each transport the same
:class:`~.packing.Packed` buckets. Everything runs on the service's event loop; blocking
work goes to a thread.

Two capabilities a transport may declare beside it, for a push whose bytes the trainer's
ranks make ready themselves (:mod:`~torchrl_vllm_ext.weight_sync.sharded`):
:class:`WrittenByRanks` (storage: a slot reserved for a layout, which the ranks write,
then published from a manifest their checksums fill) and :class:`Streamed` (broadcast:
buckets sent as the ranks gather them); :func:`capability` looks one up, naming the
transport that lacks it.

Which transports exist, and their worker and actor parts: :mod:`.registry`; what the
senders wait for on the replicas: :mod:`.waits`.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from torchrl_vllm_ext.deadlines import Deadline
from torchrl_vllm_ext.engine.calls import Outcomes
from torchrl_vllm_ext.engine.fleet import ReplicaFleet, ReplicaView
from torchrl_vllm_ext.errors import TransportCapabilityError, WeightSyncError
from torchrl_vllm_ext.weight_sync.specs import SlotManifest, SlotTarget, TensorSpec, UpdateHeader
from torchrl_vllm_ext.weight_sync.transports.packing import DEFAULT_BUCKET_BYTES, Packed

Replicas = list[ReplicaView]
"""Replicas a step is given (never edited by a transport: what it reached, it returns)."""


@dataclass(frozen=True)
class TransportOptions:
    """What a scheme gives every transport it makes (each reads what it needs)."""

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Bucket size of the packed transports."""
    deadline: Deadline = field(default_factory=Deadline)
    """How long each step of a push may wait on a replica."""
    storage_dir: str | Path | None = None
    """Root of the storage slots (None: a private tmpfs directory); a directory other hosts
    share makes ``auto`` route them through storage too."""
    backend: str | None = None
    """Broadcast's process group: ``nccl`` or ``gloo`` (None: NCCL on GPU replicas)."""
    delta_dtype: str | None = None
    """Delta pushes (:mod:`~torchrl_vllm_ext.weight_sync.delta`; storage and broadcast):
    the served dtype every push is cast to and compared in; None: full pushes, as pushed."""
    per_worker_sends: bool = False
    """Broadcast: send each worker of a tensor-parallel replica only its slices, where it
    can (:mod:`~torchrl_vllm_ext.weight_sync.transports.broadcast.per_worker`); False:
    every byte to every worker."""


@dataclass(frozen=True)
class WorkerCall:
    """The worker-extension call a replica makes inside its pause (plain-data arguments)."""

    method: str
    """A :class:`~torchrl_vllm_ext.extensions.WorkerMethods` name."""
    args: tuple = ()
    """Its positional arguments."""


@dataclass
class Prepared:
    """What :meth:`Transport.prepare` did (a value: it edits none of its caller's state)."""

    calls: dict[int, WorkerCall] = field(default_factory=dict)
    """The replicas it reached, each with the call it loads with in its pause (a replica
    that died on the way is not here: the pool's death policy restarts it)."""
    staged_in: dict[int, str] = field(default_factory=dict)
    """Where each replica staged (``device`` / ``pinned`` / ``mapped`` on GPUs; empty
    where the transport stages nothing)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds of each of its phases (``write``, ``stage``, ``pack``, ``send``, ...)."""
    sent_bytes: int | None = None
    """Bytes it moved (a delta: the changed values and their positions; storage: the bytes
    written into the slot); None: the full push, not counted apart."""
    base: str | None = None
    """The version a delta push changed (every replica reached held it); None: full."""
    sends: tuple[str, str] | None = None
    """Broadcast: how the workers were sent the bytes and why (``per-worker``: each only
    its slices; ``broadcast``: every byte to every worker); None: another transport."""

    def reached(self, replicas: Replicas) -> Replicas:
        """Those of ``replicas`` it reached, in their order."""
        return [r for r in replicas if r.replica_id in self.calls]

    def add(self, other: Prepared) -> None:
        """Fold in what another transport prepared for other replicas (``auto``'s routes);
        phases of the same name add up."""
        self.calls.update(other.calls)
        self.staged_in.update(other.staged_in)
        if other.sent_bytes is not None:
            self.sent_bytes = (self.sent_bytes or 0) + other.sent_bytes
        if other.sends is not None:
            self.sends = other.sends
        for name, seconds in other.phases.items():
            self.phases[name] = self.phases.get(name, 0.0) + seconds


def trainer_device(tensors: dict[str, torch.Tensor]) -> torch.device:
    """The one device every pushed tensor is on; a typed error naming two that differ."""
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise WeightSyncError(
            f"the pushed tensors are on {len(devices)} devices ({sorted(map(str, devices))}); "
            "push a model (or state dict) that lives on one device."
        )
    return devices.pop()


def raise_errors(outcomes: Outcomes, what: str, version: str) -> None:
    """A :class:`WeightSyncError` naming the first failed replica, if any failed."""
    if outcomes.errors:
        rid, cause = next(iter(outcomes.errors.items()))
        raise WeightSyncError(
            f"{what} of version {version} failed on replica {rid}: {cause}"
        ) from cause


class Transport(abc.ABC):
    """Moves validated weights to the replicas' workers; one per scheme (or per route of
    ``auto``). Built as ``cls(fleet, options)`` by :func:`~.registry.make_transport`.

    Examples:
        >>> class Noop(Transport):  # the smallest transport: the workers reload the checkpoint
        ...     name = "noop"
        ...     async def prepare(self, tensors, version, replicas, packed=None):
        ...         call = WorkerCall("reload_checkpoint", (version,))  # a worker method
        ...         return Prepared(calls_for(replicas, call))
        ...     async def bring_up(self, replica, version, packed=None):
        ...         await replica.handle.collective_rpc.remote("reload_checkpoint", (version,))
    """

    name: ClassVar[str]
    """The registry's name (:mod:`.registry`)."""
    checks_finite: ClassVar[bool] = False
    """Whether :meth:`prepare` rejects non-finite tensors itself (in its copy pass),
    so the scheme's validation can skip that pass."""
    loads_one_at_a_time: ClassVar[bool] = True
    """Whether replicas can load one after the other (``rollout="rolling"``)."""

    def __init__(self, fleet: ReplicaFleet, options: TransportOptions):
        self.fleet = fleet
        self.options = options
        self.deadline = options.deadline

    @property
    def label(self) -> str:
        """What the last push reports as its transport (``SyncReport.transport``): the name,
        or for ``auto`` the routes it took (``ipc+nccl``)."""
        return self.name

    @property
    def reason(self) -> str | None:
        """Why each replica went the way it did (``auto``: the plan), or None."""
        return None

    @property
    def storage_dir(self) -> Path | None:
        """The root of the slots a restarted replica can read (storage), or None."""
        return None

    @property
    def group_port(self) -> int | None:
        """The port of the process group a push goes through, once formed (TorchRL's
        master port), or None."""
        return None

    async def connect(self, replicas: Replicas, nbytes: int) -> None:
        """Bring up what every push of ``nbytes`` uses (a broadcast's group), before the first."""
        return None

    @abc.abstractmethod
    async def prepare(
        self,
        tensors: dict[str, torch.Tensor],
        version: str,
        replicas: Replicas,
        packed: Packed | None = None,
    ) -> Prepared:
        """Outside the pause: get ``tensors`` to ``replicas``; what it did, with each
        reached replica's load call (:class:`Prepared`).

        ``packed``: the same tensors packed already (``auto`` packs once for its packed
        routes); a packed transport sends those buckets instead of packing again. A
        replica that died on the way is left out where the transport can go on without
        it. Raises :class:`WeightSyncError` if no replica can load.
        """

    async def commit(self, version: str) -> None:
        """Every replica (or, for a partial failure, some replica) now serves ``version``."""
        return None

    async def rollback(self, version: str) -> None:
        """No replica loaded ``version``: restore what restarted replicas will load."""
        return None

    @abc.abstractmethod
    async def bring_up(self, replica: ReplicaView, version: str, packed: Packed | None = None):
        """Load the committed ``version`` into a restarted replica's workers (it takes no
        traffic yet; call its handle directly). ``packed``: that version's buckets, where
        the caller (``auto``) holds them and this transport may not have sent it."""

    def close(self) -> None:
        """Release what the transport holds (groups, mappings, buckets)."""
        return None


class WrittenByRanks(abc.ABC):
    """A capability of a :class:`Transport`: a push whose bytes other processes write in
    place (a sharded trainer's ranks, each its own blocks), then this transport delivers.

    Storage: :meth:`reserve_written` allocates the idle slot for the layout (the replicas
    keep reading the published one); the ranks write and checksum it; then
    :meth:`prepare_written` publishes it and runs the rest of ``prepare``.
    """

    @abc.abstractmethod
    def reserve_written(self, layout: tuple[TensorSpec, ...]) -> SlotTarget:
        """Where the writers put a push of ``layout`` (full shapes, the dtypes stored),
        allocated and not published. Blocking (it allocates the slot's files)."""

    @abc.abstractmethod
    async def prepare_written(self, manifest: SlotManifest, replicas: Replicas) -> Prepared:
        """:meth:`Transport.prepare` of what the writers wrote into the target
        (``manifest``: its version, slot, and every tensor with its checksum)."""


class Streamed(abc.ABC):
    """A capability of a :class:`Transport`: a push whose buckets come one at a time, each
    sent as it comes (a sharded trainer's ranks gather them bucket by bucket)."""

    @property
    @abc.abstractmethod
    def bucket_bytes(self) -> int:
        """The size the buckets are cut to (:func:`.packing.bucket_groups`'s layout)."""

    @abc.abstractmethod
    async def prepare_streamed(
        self, header: UpdateHeader, buckets: Iterable[torch.Tensor], replicas: Replicas
    ) -> Prepared:
        """:meth:`Transport.prepare` of ``buckets`` as they come (``header``: their layout;
        ``header.checksums_follow``: their checksums are computed as they are sent). No
        copy stays: a restarted replica waits for the next push."""


def capability(
    transport: Transport, kinds: tuple[type, ...], needed_by: str, fix: str = ""
) -> WrittenByRanks | Streamed:
    """``transport`` as the first of the capabilities ``kinds`` it declares
    (:class:`WrittenByRanks`, :class:`Streamed`); else a
    :class:`~torchrl_vllm_ext.errors.TransportCapabilityError` naming the transport, what
    ``needed_by`` it, and the ``fix``.

    Examples:
        >>> from torchrl_vllm_ext.weight_sync.transports.auto.sender import PlannedTransport
        >>> planned = object.__new__(PlannedTransport)  # no fleet needed to ask
        >>> capability(planned, (WrittenByRanks, Streamed), "a sharded push")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchrl_vllm_ext.errors.TransportCapabilityError: a sharded push needs a transport ...
    """
    for kind in kinds:
        if isinstance(transport, kind):
            return transport
    wanted = " or ".join(k.__name__ for k in kinds)
    raise TransportCapabilityError(
        f"{needed_by} needs a transport that is {wanted}; the scheme's transport "
        f"{transport.name!r} ({type(transport).__name__}) is not."
        f"{' ' + fix if fix else ''}",
        transport.name,
        tuple(k.__name__ for k in kinds),
    )


def calls_for(replicas: Replicas, call: WorkerCall) -> dict[int, WorkerCall]:
    """The same load call for every replica of ``replicas``."""
    return {r.replica_id: call for r in replicas}
