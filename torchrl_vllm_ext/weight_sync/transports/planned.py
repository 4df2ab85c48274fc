"""``transport="auto"`` on GPU replicas: each push planned per replica by where its bytes live.

``prepare``: 1) ask every new replica's workers for their GPU's UUID (once per process);
2) the trainer's device is the one CUDA device of the pushed tensors; 3) plan the routes
(:func:`..plan.plan_routes`: CUDA IPC on the trainer's GPU, NCCL layers on other GPUs,
storage or gloo where neither works; an impossible plan is refused before anything
moves); 4) pack once on the trainer's GPU and hand each route's replicas to its
sub-transport (the packed buckets are shared by IPC and every NCCL layer). Each replica
gets its own pause call; the push commits or rolls back as one version across routes.
The plan is :attr:`PlannedTransport.reason` and the report's transport name
(``ipc+nccl``, ...).

A restarted replica is planned alone and brought up from the committed buckets: by CUDA
IPC, a one-member NCCL/gloo group, or the storage slot.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray
import torch

from torchrl_vllm_ext.deadlines import Deadline
from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.protocol import WorkerMethods
from torchrl_vllm_ext.weight_sync.ipc import device_uuid, share
from torchrl_vllm_ext.weight_sync.packing import pack, unpack
from torchrl_vllm_ext.weight_sync.plan import (
    Place,
    Route,
    TransportPlan,
    normalise_uuid,
    plan_routes,
)
from torchrl_vllm_ext.weight_sync.specs import IpcUpdate, to_json
from torchrl_vllm_ext.weight_sync.transports.base import (
    Replicas,
    Transport,
    WorkerCall,
    raise_errors,
)
from torchrl_vllm_ext.weight_sync.transports.broadcast import BroadcastTransport
from torchrl_vllm_ext.weight_sync.transports.ipc import IpcTransport, trainer_device
from torchrl_vllm_ext.weight_sync.transports.storage import StorageTransport

logger = logging.getLogger(__name__)

PACKED_ROUTES: frozenset[Route] = frozenset({"ipc", "nccl", "gloo"})


class PlannedTransport(Transport):
    """Routes each replica by device (see the module docstring).

    Args:
        fleet: the replicas pushed to (a service's ``pool``).
        bucket_bytes: bucket size of the packed routes.
        deadline: how long each step may wait.
        storage_dir: the storage route's root (a directory other hosts share makes them
            storage routes too).
        planner: ``(trainer, workers, shared_dir) -> TransportPlan``;
            :func:`~..plan.plan_routes` unless given (tests route CPU replicas through
            mixed plans with it).

    Examples:
        >>> scheme = WeightSyncScheme(gpu_service)  # doctest: +SKIP
        >>> scheme.push(model.cuda(), version=1).transport, scheme.reason  # doctest: +SKIP
        ('ipc+nccl', 'ipc: replicas [0]; nccl layer 0: replicas [1]')
    """

    loads_one_at_a_time = False  # an NCCL layer reaches its replicas in one collective

    def __init__(
        self,
        fleet,
        bucket_bytes: int,
        deadline: Deadline | None = None,
        storage_dir=None,
        planner=plan_routes,
    ):
        super().__init__(fleet)
        self.planner = planner
        self.bucket_bytes = bucket_bytes
        self.deadline = deadline or Deadline()
        self.storage_dir = storage_dir
        self.plan: TransportPlan | None = None
        self._subs: dict[tuple[Route, int], Transport] = {}
        self._places: dict[tuple[int, int], list[Place]] = {}  # (replica, pid) -> workers
        self._trainer: Place | None = None
        self._used: list[Transport] = []
        self._packed = None  # (header, buffers) of the push in flight
        self._committed = None  # ... of the live version, for restarted replicas

    @property
    def name(self) -> str:
        """The routes of the last plan, joined: ``ipc``, ``ipc+nccl``, ... (``auto`` before
        the first push)."""
        if self.plan is None:
            return "auto"
        return "+".join(sorted({route for route, _ in self.plan.routes()}))

    @property
    def reason(self) -> str:
        return self.plan.reason if self.plan else "planned per replica at each push, by GPU UUID"

    # ------------------------------------------------------------------ push
    async def prepare(
        self, tensors: dict[str, torch.Tensor], version: str, replicas: Replicas, phases: dict
    ) -> dict[int, WorkerCall]:
        t0 = time.perf_counter()
        device = trainer_device(tensors)  # 2)
        self._trainer = Place(
            ray.util.get_node_ip_address(),
            device_uuid(device.index) if device.type == "cuda" else None,
        )
        places = await self._places_of(replicas)  # 1)
        replicas[:] = [r for r in replicas if r.replica_id in places]
        self.plan = self.planner(self._trainer, places, self.storage_dir is not None)  # 3)
        phases["plan"] = time.perf_counter() - t0
        logger.info("version %s: %s", version, self.plan.reason)
        self._used, self._packed, self.staged_in = [], None, {}
        calls: dict[int, WorkerCall] = {}
        try:
            for (route, layer), ids in self.plan.routes().items():  # 4)
                group = [r for r in replicas if r.replica_id in ids]
                sub = self._sub(route, layer)
                self._used.append(sub)
                if route in PACKED_ROUTES:
                    packed = await self._pack(tensors, version, phases)
                    call = await sub.prepare_packed(*packed, group, phases)
                else:
                    call = await sub.prepare(tensors, version, group, phases)
                self.staged_in.update(sub.staged_in)
                calls.update({r.replica_id: call for r in group})
        except BaseException:
            await self.rollback(version)
            raise
        replicas[:] = [r for r in replicas if r.replica_id in calls]
        return calls

    async def _pack(self, tensors, version: str, phases: dict):
        if self._packed is None:
            t0 = time.perf_counter()
            self._packed = await asyncio.to_thread(pack, tensors, version, self.bucket_bytes)
            phases["pack"] = time.perf_counter() - t0
        return self._packed

    async def commit(self, version: str) -> None:
        for sub in self._used:
            await sub.commit(version)
        if self._packed is not None:
            self._committed = self._packed
        self._packed = None

    async def rollback(self, version: str) -> None:
        for sub in self._used:
            await sub.rollback(version)
        self._packed = None

    # ------------------------------------------------------------------ restarts
    async def bring_up(self, replica, version: str) -> None:
        places = await self._places_of([replica])
        if self._trainer is None or replica.replica_id not in places:
            raise WeightSyncError(f"replica {replica.replica_id} cannot be planned for {version}.")
        plan = self.planner(self._trainer, places, self.storage_dir is not None)
        route = plan.replicas[0].route
        storage = self._subs.get(("storage", 0))
        slot = storage.writer.published() if isinstance(storage, StorageTransport) else None
        if route == "storage" and slot is not None and slot.version == version:
            await storage.bring_up(replica, version)
            return
        if self._committed is None:
            raise WeightSyncError(
                f"replica {replica.replica_id} needs route {route} but version {version} was "
                "pushed by storage only; push again to bring it up."
            )
        header, buffers = self._committed
        handle = replica.handle
        if route == "ipc":
            update = to_json(IpcUpdate(header, tuple(share(b) for b in buffers)))
            await handle.collective_rpc.remote(WorkerMethods.RECEIVE_IPC, (update,))
        elif route in ("nccl", "gloo"):
            sender = self._sub(route, 0)
            sender._committed = (to_json(header), buffers)
            await sender.bring_up(replica, version)
        else:  # storage, with no slot of this version yet: write one from the buckets
            sub = self._sub("storage", 0)
            tensors = {
                n: t
                for b, buf in zip(header.buckets, buffers, strict=True)
                for n, t in unpack(b, buf)
            }
            call = await sub.prepare(tensors, version, [replica], {})
            await handle.collective_rpc.remote(call.method, call.args)
            await sub.commit(version)

    # ------------------------------------------------------------------ parts
    async def _places_of(self, replicas: Replicas) -> dict[int, list[Place]]:
        """Each replica's workers' places (asked once per replica process)."""
        missing = [r for r in replicas if (r.replica_id, r.info.pid) not in self._places]
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
                    self._places[(r.replica_id, r.info.pid)] = [
                        Place(r.node, normalise_uuid(gpu)) for gpu in asked.results[r.replica_id]
                    ]
        return {
            r.replica_id: self._places[(r.replica_id, r.info.pid)]
            for r in replicas
            if (r.replica_id, r.info.pid) in self._places
        }

    def _sub(self, route: Route, layer: int) -> Transport:
        key = (route, layer)
        if key not in self._subs:
            if route == "ipc":
                sub = IpcTransport(self.fleet, self.bucket_bytes, self.deadline)
            elif route == "storage":
                sub = StorageTransport(self.fleet, self.storage_dir, self.deadline)
            else:
                backend = "nccl" if route == "nccl" else "gloo"
                sub = BroadcastTransport(self.fleet, self.bucket_bytes, self.deadline, backend)
            self._subs[key] = sub
        return self._subs[key]

    def close(self) -> None:
        for sub in self._subs.values():
            sub.close()
        self._subs.clear()
        self._committed = self._packed = None
