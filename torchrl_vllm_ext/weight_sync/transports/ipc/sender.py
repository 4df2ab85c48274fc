"""The CUDA IPC transport: replicas on the trainer's own GPU read its packed buckets in place.

``prepare``: 1) pack the tensors into buckets on the trainer's GPU (one device copy);
2) share each bucket (:func:`.handles.share`, once per replica process: torch's reference
counts) and send every replica its JSON update; its workers open the buckets and checksum them on the GPU in a background thread while the
engine keeps generating; 3) wait until every worker verified. In the pause the workers
copy from the buckets into their parameters (``apply_staged_weights``): a device-to-device
copy. The committed buckets stay alive for restarted replicas (``receive_weight_ipc``).

The buckets are two sets, A and B (:class:`~..versions.PackedVersions`), re-packed in place: the
committed version's set stays intact while the other takes the next push, each set is
shared once per replica (the same handles in every update to it), and the workers keep their mappings of
both (:class:`.handles.OpenedBuckets`), so no push opens new IPC handles; ``close`` has
them unmap (``release_weight_ipc``).

NCCL refuses two ranks on one GPU, so this is how a trainer reaches replicas that share
its GPU; ``auto``'s plan routes them here. Its receiver: :mod:`.receiver`.
"""

from __future__ import annotations

import asyncio
import time

import torch

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.extensions import WorkerMethods
from torchrl_vllm_ext.weight_sync.specs import IpcUpdate, to_json
from torchrl_vllm_ext.weight_sync.transports.ipc.handles import SharedBuckets, share
from torchrl_vllm_ext.weight_sync.transports.packing import Packed
from torchrl_vllm_ext.weight_sync.transports.protocol import (
    Prepared,
    Replicas,
    Transport,
    TransportOptions,
    WorkerCall,
    calls_for,
    raise_errors,
    trainer_device,
)
from torchrl_vllm_ext.weight_sync.transports.versions import PackedVersions
from torchrl_vllm_ext.weight_sync.transports.waits import release_on_replicas, wait_staged


class IpcTransport(Transport):
    """Weights by CUDA IPC from the trainer's GPU to replicas on that GPU.

    Args:
        fleet: the replicas pushed to (a service's ``pool``).
        options: ``bucket_bytes`` and ``deadline`` (how long each step may wait).

    Examples:
        >>> scheme = WeightSyncScheme(service)  # doctest: +SKIP
        >>> scheme.push(model.cuda(), version=1).transport  # doctest: +SKIP
        'ipc'
    """

    name = "ipc"

    def __init__(self, fleet, options: TransportOptions):
        super().__init__(fleet, options)
        self._versions = PackedVersions()  # the buckets, re-packed in place push after push
        self._shared = SharedBuckets()  # their handles, shared once per set and replica

    async def prepare(
        self,
        tensors: dict[str, torch.Tensor],
        version: str,
        replicas: Replicas,
        packed: Packed | None = None,
    ) -> Prepared:
        phases: dict[str, float] = {}
        if packed is None:
            if trainer_device(tensors).type != "cuda":
                raise WeightSyncError(
                    "CUDA IPC needs the pushed tensors on the trainer's GPU; they are on the "
                    "CPU. Move the model to its GPU, or use transport='storage'."
                )
            t0 = time.perf_counter()
            packed = await asyncio.to_thread(
                self._versions.pack, tensors, version, self.options.bucket_bytes
            )
            phases["pack"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        updates = self._updates(packed, replicas)
        nbytes = packed.nbytes
        staged = await self.fleet.call_each(
            lambda r: r.handle.collective_rpc.remote(
                WorkerMethods.STAGE_IPC, (updates[r.replica_id],)
            ),
            replicas,
            "collective_rpc",
            deadline=self.deadline.answer_s,
        )
        raise_errors(staged, "stage", version)
        replicas = await wait_staged(
            self.fleet,
            [r for r in replicas if r.replica_id in staged.results],
            version,
            self.deadline.for_bytes(nbytes),
            self.deadline.answer_s,
        )
        self._versions.stage(packed)
        phases["share"] = time.perf_counter() - t0
        call = WorkerCall(WorkerMethods.APPLY_STAGED, (version,))
        return Prepared(
            calls_for(replicas, call), {r.replica_id: "device" for r in replicas}, phases
        )

    def _updates(self, packed: Packed, replicas: Replicas) -> dict[int, str]:
        """Each replica's JSON update of CUDA IPC handles to ``packed``'s buckets (a set
        shared with its process before keeps its handles: the workers find their mappings
        by them; IPC replicas have one worker)."""
        torch.cuda.synchronize(packed.buffers[0].device)  # the buckets are complete first
        return {
            r.replica_id: to_json(
                IpcUpdate(
                    packed.header,
                    self._shared.handles(packed.buffers, r.process, share),
                )
            )
            for r in replicas
        }

    async def commit(self, version: str) -> None:
        # The workers copied out of the buckets in their pause; the set of the previous
        # version takes the next push (re-packed in place: the workers keep its mappings).
        self._versions.commit()

    async def rollback(self, version: str) -> None:
        self._versions.rollback()

    async def bring_up(self, replica, version: str, packed: Packed | None = None) -> None:
        if packed is None or packed.version != version:
            packed = self._versions.committed  # else the caller's: it keeps the buckets alive
        if packed is not None and packed.version == version:
            update = self._updates(packed, [replica])[replica.replica_id]  # its own share
        else:
            raise WeightSyncError(
                f"no committed CUDA IPC update of version {version} to bring replica "
                f"{replica.replica_id} up; push again."
            )
        await replica.handle.collective_rpc.remote(WorkerMethods.RECEIVE_IPC, (update,))

    def close(self) -> None:
        """Have every replica drop its mappings of the buckets (the trainer's GPU memory is
        freed once nobody maps them), then drop them."""
        release_on_replicas(
            self.fleet,
            lambda r: [r.handle.collective_rpc.remote(WorkerMethods.RELEASE_IPC)],
            "unmap the IPC buckets",
        )
        self._versions.clear()
        self._shared.clear()
