"""The CUDA IPC transport: replicas on the trainer's own GPU read its packed buckets in place.

``prepare``: 1) pack the tensors into buckets on the trainer's GPU (one device copy);
2) share each bucket (:func:`..ipc.share`) and send every replica one JSON update; its
workers open the buckets and checksum them on the GPU in a background thread while the
engine keeps generating; 3) wait until every worker verified. In the pause the workers
copy from the buckets into their parameters (``load_staged_weights``): a device-to-device
copy. The committed buckets stay alive for restarted replicas (``receive_weight_ipc``).

NCCL refuses two ranks on one GPU, so this is how a trainer reaches replicas that share
its GPU; :mod:`..plan` routes them here.
"""

from __future__ import annotations

import asyncio
import time

import torch

from torchrl_vllm_ext.deadlines import Deadline
from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.protocol import WorkerMethods
from torchrl_vllm_ext.weight_sync.ipc import share
from torchrl_vllm_ext.weight_sync.packing import pack
from torchrl_vllm_ext.weight_sync.specs import IpcUpdate, to_json
from torchrl_vllm_ext.weight_sync.transports.base import (
    Replicas,
    Transport,
    WorkerCall,
    raise_errors,
    wait_staged,
)


def trainer_device(tensors: dict[str, torch.Tensor]) -> torch.device:
    """The one device every pushed tensor is on; a typed error naming two that differ."""
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise WeightSyncError(
            f"the pushed tensors are on {len(devices)} devices ({sorted(map(str, devices))}); "
            "push a model (or state dict) that lives on one device."
        )
    return devices.pop()


class IpcTransport(Transport):
    """Weights by CUDA IPC from the trainer's GPU to replicas on that GPU.

    Args:
        fleet: the replicas pushed to (a service's ``pool``).
        bucket_bytes: bucket size.
        deadline: how long each step may wait.

    Examples:
        >>> scheme = WeightSyncScheme(service)  # doctest: +SKIP
        >>> scheme.push(model.cuda(), version=1).transport  # doctest: +SKIP
        'ipc'
    """

    name = "ipc"

    def __init__(self, fleet, bucket_bytes: int, deadline: Deadline | None = None):
        super().__init__(fleet)
        self.bucket_bytes = bucket_bytes
        self.deadline = deadline or Deadline()
        self._staged: tuple[str, list[torch.Tensor]] | None = None
        self._committed: tuple[str, list[torch.Tensor]] | None = None

    async def prepare(
        self, tensors: dict[str, torch.Tensor], version: str, replicas: Replicas, phases: dict
    ) -> WorkerCall:
        if trainer_device(tensors).type != "cuda":
            raise WeightSyncError(
                "CUDA IPC needs the pushed tensors on the trainer's GPU; they are on the CPU. "
                "Move the model to its GPU, or use transport='storage'."
            )
        t0 = time.perf_counter()
        header, buffers = await asyncio.to_thread(pack, tensors, version, self.bucket_bytes)
        phases["pack"] = time.perf_counter() - t0
        return await self.prepare_packed(header, buffers, replicas, phases)

    async def prepare_packed(self, header, buffers, replicas: Replicas, phases: dict) -> WorkerCall:
        """:meth:`prepare` from buckets packed already (on the trainer's GPU)."""
        version = header.version
        t0 = time.perf_counter()
        torch.cuda.synchronize(buffers[0].device)  # the buckets are complete before sharing
        update = to_json(IpcUpdate(header, tuple(share(b) for b in buffers)))
        nbytes = sum(b.numel() for b in buffers)
        staged = await self.fleet.call_all(
            "collective_rpc",
            WorkerMethods.STAGE_IPC,
            (update,),
            replicas=replicas,
            deadline=self.deadline.answer_s,
        )
        raise_errors(staged, "stage", version)
        replicas[:] = [r for r in replicas if r.replica_id in staged.results]
        await wait_staged(
            self.fleet, replicas, version, self.deadline.for_bytes(nbytes), self.deadline.answer_s
        )
        self._staged = (update, buffers)
        self.staged_in = {r.replica_id: "device" for r in replicas}
        phases["share"] = phases.get("share", 0.0) + time.perf_counter() - t0
        return WorkerCall(WorkerMethods.LOAD_STAGED, (version,))

    async def commit(self, version: str) -> None:
        # The workers copied out of the buckets in their pause: the previous committed
        # buckets are free once no worker maps them (torch's IPC ref counter).
        self._committed, self._staged = self._staged, None

    async def rollback(self, version: str) -> None:
        self._staged = None

    async def bring_up(self, replica, version: str) -> None:
        if self._committed is None:
            raise WeightSyncError(f"no committed CUDA IPC update to bring replica up to {version}.")
        update, _buffers = self._committed
        await replica.handle.collective_rpc.remote(WorkerMethods.RECEIVE_IPC, (update,))

    def close(self) -> None:
        self._staged = self._committed = None
