"""``transport="auto"``: on CPU replicas the scheme picks storage or gloo once; on GPU
replicas each push is planned per replica by where its bytes live.

``prepare``: 1) ask every new replica's workers for their GPU's UUID (once per process:
:mod:`.receiver`); 2) the trainer's device is the one CUDA device of the pushed tensors;
3) plan the routes (:func:`.plan.plan_routes`: CUDA IPC on the trainer's GPU, NCCL layers on
other GPUs, storage or gloo where neither works; an impossible plan is refused before
anything moves); 4) pack once on the trainer's GPU and hand each route's replicas to the
transport the registry names for the route (:data:`~..registry.ROUTES`; the packed buckets
are shared by IPC and every NCCL layer). Each replica gets its own pause call; the push
commits or rolls back as one version across routes. The plan is
:attr:`PlannedTransport.reason` and the report's transport name (``ipc+nccl``, ...).

It composes the other transports only through the protocol (:mod:`..protocol`): a restarted
replica is planned alone and its route's transport brings it up from the committed buckets
(by CUDA IPC, a one-member NCCL/gloo group, or a storage slot written from them).
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray
import torch

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.extensions import WorkerMethods
from torchrl_vllm_ext.weight_sync.transports import registry
from torchrl_vllm_ext.weight_sync.transports.auto.plan import (
    Place,
    Route,
    TransportPlan,
    plan_routes,
)
from torchrl_vllm_ext.weight_sync.transports.devices import device_uuid, normalise_uuid
from torchrl_vllm_ext.weight_sync.transports.packing import Packed
from torchrl_vllm_ext.weight_sync.transports.protocol import (
    Prepared,
    Replicas,
    Transport,
    TransportOptions,
    raise_errors,
    trainer_device,
)
from torchrl_vllm_ext.weight_sync.transports.versions import PackedVersions

logger = logging.getLogger(__name__)


class PlannedTransport(Transport):
    """Routes each replica by device (see the module docstring).

    Args:
        fleet: the replicas pushed to (a service's ``pool``).
        options: what every route's transport is made with (``bucket_bytes`` of the
            packed routes, ``deadline``, ``storage_dir``: the storage route's root, a
            directory other hosts share makes them storage routes too).

    Examples:
        >>> scheme = WeightSyncScheme(gpu_service)  # doctest: +SKIP
        >>> scheme.push(model.cuda(), version=1).transport, scheme.reason  # doctest: +SKIP
        ('ipc+nccl', 'ipc: replicas [0]; nccl layer 0: replicas [1]')
    """

    name = "auto"
    loads_one_at_a_time = False  # an NCCL layer reaches its replicas in one collective

    def __init__(self, fleet, options: TransportOptions):
        super().__init__(fleet, options)
        self.plan: TransportPlan | None = None
        self._subs: dict[tuple[Route, int], Transport] = {}
        self._places: dict[str, list[Place]] = {}  # replica process -> its workers' places
        self._trainer: Place | None = None
        self._used: list[Transport] = []
        # The push in flight (packed once for every packed route) and the live version (for
        # restarted replicas), in two sets re-packed in place (IPC mappings stay).
        self._versions = PackedVersions()

    @property
    def label(self) -> str:
        """The routes of the last plan, joined: ``ipc``, ``ipc+nccl``, ... (``auto`` before
        the first push)."""
        if self.plan is None:
            return "auto"
        return "+".join(sorted({route for route, _ in self.plan.routes()}))

    @property
    def reason(self) -> str:
        return self.plan.reason if self.plan else "planned per replica at each push, by GPU UUID"

    @property
    def group_port(self) -> int | None:
        """The first route's group port (NCCL / gloo layers), if any formed."""
        return next((s.group_port for s in self._subs.values() if s.group_port), None)

    @property
    def _shared_dir(self) -> bool:
        return self.options.storage_dir is not None

    # ------------------------------------------------------------------ push
    async def prepare(
        self,
        tensors: dict[str, torch.Tensor],
        version: str,
        replicas: Replicas,
        packed: Packed | None = None,
    ) -> Prepared:
        t0 = time.perf_counter()
        device = trainer_device(tensors)  # 2)
        self._trainer = Place(
            ray.util.get_node_ip_address(),
            device_uuid(device.index) if device.type == "cuda" else None,
        )
        places = await self._places_of(replicas)  # 1)
        replicas = [r for r in replicas if r.replica_id in places]
        self.plan = self._plan(places)  # 3)
        prepared = Prepared(phases={"plan": time.perf_counter() - t0})
        logger.info("version %s: %s", version, self.plan.reason)
        self._used = []
        self._versions.stage(packed)
        try:
            for (route, layer), ids in self.plan.routes().items():  # 4)
                group = [r for r in replicas if r.replica_id in ids]
                sub = self._sub(route, layer)
                self._used.append(sub)
                buckets = None
                if registry.ROUTES[route].packed:
                    buckets = await self._pack(tensors, version, prepared.phases)
                prepared.add(await sub.prepare(tensors, version, group, buckets))
        except BaseException:
            await self.rollback(version)
            raise
        return prepared

    async def _pack(self, tensors, version: str, phases: dict) -> Packed:
        """The push packed, once for every packed route."""
        if self._versions.staged is None:
            t0 = time.perf_counter()
            bucket_bytes = self.options.bucket_bytes
            packed = await asyncio.to_thread(self._versions.pack, tensors, version, bucket_bytes)
            self._versions.stage(packed)
            phases["pack"] = time.perf_counter() - t0
        return self._versions.staged

    def _plan(self, places: dict[int, list[Place]]) -> TransportPlan:
        """The routes of the replicas at ``places`` (:func:`~.plan.plan_routes`)."""
        return plan_routes(self._trainer, places, self._shared_dir)

    async def commit(self, version: str) -> None:
        for sub in self._used:
            await sub.commit(version)
        self._versions.commit()

    async def rollback(self, version: str) -> None:
        for sub in self._used:
            await sub.rollback(version)
        self._versions.rollback()

    # ------------------------------------------------------------------ restarts
    async def bring_up(self, replica, version: str, packed: Packed | None = None) -> None:
        places = await self._places_of([replica])
        if self._trainer is None or replica.replica_id not in places:
            raise WeightSyncError(f"replica {replica.replica_id} cannot be planned for {version}.")
        route = self._plan(places).replicas[0].route
        await self._sub(route, 0).bring_up(replica, version, packed or self._versions.committed)

    # ------------------------------------------------------------------ parts
    async def _places_of(self, replicas: Replicas) -> dict[int, list[Place]]:
        """Each replica's workers' places (asked once per replica process)."""
        missing = [r for r in replicas if r.process not in self._places]
        if missing:
            asked = await self.fleet.call_all(
                "collective_rpc",
                WorkerMethods.DEVICE,
                replicas=missing,
                deadline=self.deadline.answer_s,
            )
            raise_errors(asked, "device query", "(plan)")
            for r in missing:
                if r.replica_id in asked.results:
                    self._places[r.process] = [
                        Place(r.node, normalise_uuid(gpu)) for gpu in asked.results[r.replica_id]
                    ]
        return {
            r.replica_id: self._places[r.process] for r in replicas if r.process in self._places
        }

    def _sub(self, route: Route, layer: int) -> Transport:
        """The transport of ``route`` (NCCL: one per layer), made once."""
        key = (route, layer)
        if key not in self._subs:
            self._subs[key] = registry.make_route(route, self.fleet, self.options)
        return self._subs[key]

    def close(self) -> None:
        for sub in self._subs.values():
            sub.close()
        self._subs.clear()
        self._versions.clear()
