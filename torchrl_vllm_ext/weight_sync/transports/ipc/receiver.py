"""The CUDA IPC transport's receiver (vLLM worker side): open the trainer's buckets on this
GPU and checksum them there (before the pause), or load them at once (a restarted
replica). Its sender: :mod:`.sender`."""

from __future__ import annotations

import torch

from torchrl_vllm_ext.weight_sync.loading.loads import Loads
from torchrl_vllm_ext.weight_sync.params import device_checksums
from torchrl_vllm_ext.weight_sync.specs import IpcUpdate, from_json
from torchrl_vllm_ext.weight_sync.transports.ipc.handles import OpenedBuckets
from torchrl_vllm_ext.weight_sync.transports.packing import unpack, verify_checksums


class IpcReceiver:
    """The CUDA IPC transport's part of a worker's weight sync (the worker extension's IPC
    methods delegate here).

    Args:
        loads: the worker's shared staging and loading step.
    """

    def __init__(self, loads: Loads):
        self.loads = loads
        self.opened: OpenedBuckets | None = None
        """The trainer's buckets mapped by CUDA IPC, kept from push to push (the trainer
        re-packs its two sets in place, so most updates open nothing)."""

    def stage_weight_ipc(self, update_json: str) -> bool:
        """Open the trainer's buckets on this GPU (CUDA IPC, no copy) and checksum them on
        the GPU, in a background thread; the pause then copies them into the parameters."""
        update = from_json(update_json, IpcUpdate)
        return self.loads.stage(update.header.version, lambda: self._open(update))

    def receive_weight_ipc(self, update_json: str) -> str:
        """Open, verify and load one CUDA IPC update (a restarted replica); its version."""
        update = from_json(update_json, IpcUpdate)
        self.loads.load(self._open(update), update.header.version)
        return update.header.version

    def release_weight_ipc(self) -> bool:
        """Drop this worker's mappings of the trainer's buckets (its transport closed: the
        trainer's GPU memory is freed once nobody maps it); whether it held any."""
        opened, self.opened = self.opened, None
        held = bool(opened)
        if opened is not None:
            opened.clear()
        return held

    def _open(self, update: IpcUpdate) -> list[tuple[str, torch.Tensor]]:
        if self.opened is None:
            self.opened = OpenedBuckets()
        buffers = self.opened.open(update.handles)
        header = update.header
        sums = device_checksums(buffers)  # on the GPU, one sync for every bucket
        verify_checksums(
            header.version, sums, [b.checksum for b in header.buckets], "read through CUDA IPC"
        )
        return [
            item for b, buf in zip(header.buckets, buffers, strict=True) for item in unpack(b, buf)
        ]
