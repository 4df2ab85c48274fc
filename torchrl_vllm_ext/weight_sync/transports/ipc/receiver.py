"""The CUDA IPC transport's receiver (vLLM worker side): open the trainer's buckets on this
GPU and checksum them there (before the pause), or load them at once (a restarted
replica). Its sender: :mod:`.sender`."""

from __future__ import annotations

import torch

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.weight_sync.params import device_checksum
from torchrl_vllm_ext.weight_sync.specs import IpcUpdate, from_json
from torchrl_vllm_ext.weight_sync.transports.ipc.handles import open_bucket
from torchrl_vllm_ext.weight_sync.transports.packing import unpack


class IpcReceiver:
    """Worker methods of the CUDA IPC transport (``self``: vLLM's Worker, with
    :class:`~..receiving.Receiving`)."""

    def stage_weight_ipc(self, update_json: str) -> bool:
        """Open the trainer's buckets on this GPU (CUDA IPC, no copy) and checksum them on
        the GPU, in a background thread; the pause then copies them into the parameters."""
        update = from_json(update_json, IpcUpdate)
        return self._tvllm_stage(update.header.version, lambda: self._tvllm_open_ipc(update))

    def receive_weight_ipc(self, update_json: str) -> str:
        """Open, verify and load one CUDA IPC update (a restarted replica); its version."""
        update = from_json(update_json, IpcUpdate)
        self._tvllm_load(self._tvllm_open_ipc(update), update.header.version)
        return update.header.version

    def _tvllm_open_ipc(self, update: IpcUpdate) -> list[tuple[str, torch.Tensor]]:
        out = []
        for i, (bucket, handle) in enumerate(
            zip(update.header.buckets, update.handles, strict=True)
        ):
            buf = open_bucket(handle)
            got = device_checksum(buf)
            if got != bucket.checksum:
                raise WeightSyncError(
                    f"bucket {i} of version {update.header.version} read through CUDA IPC does "
                    f"not match the trainer's (checksum {got} != {bucket.checksum}); nothing "
                    "was loaded."
                )
            out.extend(unpack(bucket, buf))
        return out
