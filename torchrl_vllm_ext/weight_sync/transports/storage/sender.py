"""The storage transport: a memory-mapped A/B double buffer that workers load from.

``prepare``: 1) the writer fills the idle slot in place (copy, finiteness check and
checksums in one pass; with delta pushes on, cast to the served dtype: a slot holds whole
versions, see :mod:`...delta`) and publishes its manifest atomically; 2) each replica actor
checksums the published slot while its engine keeps generating; 3) on GPUs, each worker
copies the slot to its staging buffer (reserved at the first sync and kept: on the device,
or in pinned host memory when the GPU lacks room or the replica has sleep mode, or not at
all when a pinned copy per worker would not fit the host: :mod:`...staging`) in a
background thread. In the pause the workers only copy in, by
their load plan's replay (:mod:`torchrl_vllm_ext.weight_sync.loading.planned`): from the slot on CPUs
(``apply_weights_from_storage(root, version)``), from the staging buffer on GPUs
(``apply_staged_weights``).
A restarted replica loads the published slot, so a push that no replica loaded
publishes the previous version again. ``close`` has the replicas drop their mappings
and removes the slots (see :class:`~.slots.SlotWriter`). Its receiver: :mod:`.receiver`;
its part in the replica actor (the checksum pass): :mod:`.actor`.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import torch

from torchrl_vllm_ext import leftovers
from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.extensions import ActorMethods, WorkerMethods
from torchrl_vllm_ext.weight_sync.params import require_all_finite, require_finite, torch_dtype
from torchrl_vllm_ext.weight_sync.specs import SlotManifest, SlotTarget, TensorSpec
from torchrl_vllm_ext.weight_sync.transports.packing import Packed
from torchrl_vllm_ext.weight_sync.transports.protocol import (
    Prepared,
    Replicas,
    Transport,
    TransportOptions,
    WorkerCall,
    WrittenByRanks,
    calls_for,
    raise_errors,
)
from torchrl_vllm_ext.weight_sync.transports.storage.slots import SlotWriter
from torchrl_vllm_ext.weight_sync.transports.waits import release_on_replicas, wait_staged


class StorageTransport(Transport, WrittenByRanks):
    """Weights through two memory-mapped TensorDict slots (see :mod:`.slots`); a slot
    other processes write too (:class:`~..protocol.WrittenByRanks`).

    Args:
        fleet: the replicas pushed to (a service's ``pool``).
        options: ``storage_dir``, the root of the slots (default: a private tmpfs
            directory; on a multi-host cluster, a directory every host shares), and
            ``deadline``, how long a replica may take to checksum the slot (a replica that
            takes longer is handled as dead and the push goes on without it).

    Examples:
        >>> scheme = WeightSyncScheme(service, transport="storage")  # doctest: +SKIP
        >>> scheme.transport_impl.root  # doctest: +SKIP
        '/dev/shm/torchrl-vllm-weights-...'
    """

    name = "storage"
    checks_finite = True

    def __init__(self, fleet, options: TransportOptions):
        super().__init__(fleet, options)
        leftovers.reap()  # slots of writers that were killed
        self.writer = SlotWriter(options.storage_dir)
        self._previous: SlotManifest | None = None
        self._dtype = torch_dtype(options.delta_dtype) if options.delta_dtype else None

    @property
    def root(self) -> str:
        return str(self.writer.root)

    @property
    def storage_dir(self) -> Path:
        return self.writer.root

    async def prepare(
        self,
        tensors: dict[str, torch.Tensor],
        version: str,
        replicas: Replicas,
        packed: Packed | None = None,  # the slot is written from the tensors either way
    ) -> Prepared:
        t0 = time.perf_counter()
        self._previous = self.writer.published()
        await asyncio.to_thread(self._write, tensors, version)  # 1)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        prepared = await self._stage(version, replicas, nbytes, {"write": time.perf_counter() - t0})
        prepared.sent_bytes = self.writer.written
        return prepared

    def reserve_written(self, layout: tuple[TensorSpec, ...]) -> SlotTarget:
        """The idle slot, allocated for ``layout`` (:meth:`SlotWriter.idle`)."""
        shapes = tuple((s.name, tuple(s.shape), torch_dtype(s.dtype)) for s in layout)
        slot, path = self.writer.idle(shapes)
        return SlotTarget(slot, str(path))

    async def prepare_written(self, manifest: SlotManifest, replicas: Replicas) -> Prepared:
        """``prepare`` of a slot other processes filled (a sharded trainer's ranks, in the
        slot :meth:`reserve_written` gave them, checksummed into ``manifest``): publish
        it, then the same steps."""
        t0 = time.perf_counter()
        self._previous = self.writer.published()
        await asyncio.to_thread(self.writer.publish, manifest)  # 1)
        nbytes = sum(torch_dtype(s.dtype).itemsize * math.prod(s.shape) for s in manifest.tensors)
        phases = {"publish": time.perf_counter() - t0}
        return await self._stage(manifest.version, replicas, nbytes, phases)

    async def _stage(
        self, version: str, replicas: Replicas, nbytes: int, phases: dict[str, float]
    ) -> Prepared:
        """2) and 3) of a published slot."""
        t1 = time.perf_counter()
        staged = await self.fleet.call_all(  # 2)
            "extension_call",
            ActorMethods.STAGE_STORAGE,
            (self.root, version),
            replicas=replicas,
            deadline=self.deadline.for_bytes(nbytes),
        )
        try:
            raise_errors(staged, "stage", version)
        except WeightSyncError:
            await self.rollback(version)
            raise
        replicas = [r for r in replicas if r.replica_id in staged.results]
        phases["stage"] = time.perf_counter() - t1
        if not self.fleet.uses_gpu:
            call = WorkerCall(WorkerMethods.APPLY_STORAGE, (self.root, version))
            return Prepared(calls_for(replicas, call), phases=phases)
        t2 = time.perf_counter()  # 3)
        try:
            replicas, staged_in = await self._stage_on_gpus(replicas, version, nbytes)
        except WeightSyncError:
            await self.rollback(version)
            raise
        phases["gpu_stage"] = time.perf_counter() - t2
        call = WorkerCall(WorkerMethods.APPLY_STAGED, (version,))
        return Prepared(calls_for(replicas, call), staged_in, phases)

    def _write(self, tensors: dict[str, torch.Tensor], version: str) -> None:
        """Fill and publish the idle slot, rejecting NaN / inf: in the copy pass for host
        tensors (while each is in cache), before it for GPU ones (batched: one sync, not
        one per tensor)."""
        if any(t.is_cuda for t in tensors.values()):
            require_all_finite(tensors)
            self.writer.write(tensors, version, dtype=self._dtype)
        else:
            self.writer.write(tensors, version, require_finite, self._dtype)

    async def _stage_on_gpus(
        self, replicas: Replicas, version: str, nbytes: int
    ) -> tuple[Replicas, dict[int, str]]:
        """3) Every GPU worker copies the slot to its staging buffers before the pause; the
        replicas that did, and where each staged."""
        placed = await self.fleet.call_all(
            "collective_rpc",
            WorkerMethods.STAGE_FROM_STORAGE,
            (self.root, version),
            replicas=replicas,
            deadline=self.deadline.answer_s,
        )
        raise_errors(placed, "stage", version)
        replicas = [r for r in replicas if r.replica_id in placed.results]
        # A replica is as fast as its slowest worker: mapped, then pinned, if any worker is.
        staged_in = {
            rid: next((p for p in ("mapped", "pinned") if p in places), "device")
            for rid, places in placed.results.items()
        }
        replicas = await wait_staged(
            self.fleet, replicas, version, self.deadline.for_bytes(nbytes), self.deadline.answer_s
        )
        return replicas, {r.replica_id: staged_in[r.replica_id] for r in replicas}

    async def rollback(self, version: str) -> None:
        if self._previous is not None:
            # Restarted replicas load the published slot: point it back at the version
            # the replicas still serve (a write only ever fills the other slot).
            await asyncio.to_thread(self.writer.publish, self._previous)

    async def bring_up(self, replica, version: str, packed: Packed | None = None) -> None:
        published = self.writer.published()
        if published is None or published.version != version:
            if packed is None or packed.version != version:
                raise WeightSyncError(
                    f"replica {replica.replica_id}: no storage slot holds version {version}; "
                    "push again to bring it up."
                )
            # auto sent this version by other routes: write a slot of it from the buckets.
            await asyncio.to_thread(self._write, packed.tensors(), version)
        await replica.handle.collective_rpc.remote(
            WorkerMethods.LOAD_FROM_STORAGE, (self.root, version)
        )

    def close(self) -> None:
        """Have every replica drop its mappings of the slots, then remove them."""
        root = (self.root,)
        release_on_replicas(
            self.fleet,
            lambda r: [
                r.handle.extension_call.remote(ActorMethods.RELEASE_STORAGE, root),
                r.handle.collective_rpc.remote(WorkerMethods.RELEASE_STORAGE, root),
            ],
            f"unmap the slots of {self.root}",
        )
        self.writer.close()
