"""The broadcast transport: packed buckets over a process group of the trainer and every
replica worker (NCCL on GPU, gloo on CPU; see :mod:`..collective`).

``prepare``: 1) pack same-dtype tensors into buckets; 2) form the group if its members
changed; 3) one header per replica (``stage_weight_broadcast``): its workers receive and
verify the buckets in a background thread while still generating; 4) one collective per
bucket; 5) wait until every worker has verified. In the pause the workers only load
(``load_staged_weights``). A collective cannot lose a member: a replica that dies
during a push fails the push and the group is formed again on the next one.
"""

from __future__ import annotations

import asyncio
import time

import ray
import torch

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.protocol import WorkerMethods
from torchrl_vllm_ext.weight_sync.collective import BroadcastGroup, listen
from torchrl_vllm_ext.weight_sync.packing import pack
from torchrl_vllm_ext.weight_sync.specs import to_json
from torchrl_vllm_ext.weight_sync.transports.base import (
    Outcomes,
    Replicas,
    Transport,
    WorkerCall,
    raise_errors,
)

STAGED_POLL_S = 0.005
"""Seconds between checks that every worker verified the staged buckets."""


class BroadcastTransport(Transport):
    """Weights as packed buckets broadcast from the trainer (rank 0) to every worker.

    Args:
        fleet: the replicas pushed to (a service's ``pool``).
        bucket_bytes: bucket size.
        timeout_s: the group's collective timeout.

    Examples:
        >>> scheme = WeightSyncScheme(service, transport="broadcast")  # doctest: +SKIP
        >>> scheme.transport_impl.backend  # doctest: +SKIP
        'gloo'
    """

    name = "broadcast"
    loads_one_at_a_time = False

    def __init__(self, fleet, bucket_bytes: int, timeout_s: float):
        super().__init__(fleet)
        self.backend = "nccl" if torch.cuda.is_available() and fleet.uses_gpu else "gloo"
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.group: BroadcastGroup | None = None
        self._members: tuple = ()
        self._staged: tuple[str, list[torch.Tensor]] | None = None
        self._committed: tuple[str, list[torch.Tensor]] | None = None  # for restarts

    async def prepare(
        self, tensors: dict[str, torch.Tensor], version: str, replicas: Replicas, phases: dict
    ) -> WorkerCall:
        t0 = time.perf_counter()
        header, buffers = await asyncio.to_thread(pack, tensors, version, self.bucket_bytes)  # 1)
        header_json = to_json(header)
        t1 = time.perf_counter()
        await self._ensure_group(replicas)  # 2)
        staged = await self.fleet.call_all(  # 3)
            "collective_rpc", WorkerMethods.STAGE_BROADCAST, (header_json,), replicas=replicas
        )
        self._check(staged, "stage", version)
        try:
            await asyncio.to_thread(self.group.send, buffers)  # 4)
        except Exception as e:
            self._drop_group()
            raise WeightSyncError(
                f"broadcast of version {version} failed: {e}; replicas keep their weights."
            ) from e
        await self._wait_staged(replicas, version)  # 5)
        self._staged = (header_json, buffers)
        phases.update(pack=t1 - t0, send=time.perf_counter() - t1)
        return WorkerCall(WorkerMethods.LOAD_STAGED, (version,))

    def _check(self, outcomes: Outcomes, what: str, version: str) -> None:
        if outcomes.dead:
            self._drop_group()
            raise WeightSyncError(
                f"replica(s) {sorted(outcomes.dead)} died during {what} of version {version}; the "
                "broadcast group is broken, so no replica loaded it. The service restarts the "
                "dead replica(s); push again."
            )
        raise_errors(outcomes, what, version)

    async def _wait_staged(self, replicas: Replicas, version: str) -> None:
        while True:
            ready = await self.fleet.call_all(
                "collective_rpc", WorkerMethods.STAGED_READY, (version,), replicas=replicas
            )
            self._check(ready, "receive", version)
            if all(all(per_worker) for per_worker in ready.results.values()):
                return
            await asyncio.sleep(STAGED_POLL_S)

    async def commit(self, version: str) -> None:
        self._committed = self._staged

    async def bring_up(self, replica, version: str) -> None:
        header_json, buffers = self._committed
        handle = replica.handle
        group = await self._form_group([replica])
        try:
            ref = handle.collective_rpc.remote(WorkerMethods.RECEIVE_BROADCAST, (header_json,))
            await asyncio.to_thread(group.send, buffers)
            await ref
            await handle.collective_rpc.remote(WorkerMethods.CLOSE_BROADCAST)
        finally:
            group.close()

    # ------------------------------------------------------------------ the group
    async def _form_group(self, replicas: Replicas) -> BroadcastGroup:
        host = ray.util.get_node_ip_address()
        listener = listen(host)  # bound before the workers are told its port: no race
        port = listener.getsockname()[1]
        n = self.fleet.workers_per_replica
        world = 1 + n * len(replicas)
        joins = [
            r.handle.collective_rpc.remote(
                WorkerMethods.INIT_BROADCAST,
                (host, port, world, 1 + i * n, self.backend, self.timeout_s),
            )
            for i, r in enumerate(replicas)
        ]
        # Rank 0's store blocks until every worker joined.
        group = await asyncio.to_thread(
            BroadcastGroup, self.backend, host, port, world, self.timeout_s, listener
        )
        await asyncio.gather(*joins)
        return group

    async def _ensure_group(self, replicas: Replicas) -> None:
        members = tuple((r.replica_id, r.info.pid) for r in replicas)
        if self.group is not None and members == self._members:
            return
        self._drop_group()
        self.group = await self._form_group(replicas)
        self._members = members

    def _drop_group(self) -> None:
        if self.group is not None:
            for r in self.fleet.ready():
                if (r.replica_id, r.info.pid) in self._members:
                    r.handle.collective_rpc.remote(WorkerMethods.CLOSE_BROADCAST)
            self.group.close()
        self.group, self._members = None, ()

    def close(self) -> None:
        self._drop_group()
