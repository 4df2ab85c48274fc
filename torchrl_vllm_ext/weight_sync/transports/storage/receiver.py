"""The storage transport's receiver (vLLM worker side): load the published slot, or stage
it on the GPU before the pause. Its sender: :mod:`.sender`; the replica actor's checksum
pass: :mod:`.actor`."""

from __future__ import annotations

import logging

import psutil
import torch

from torchrl_vllm_ext.weight_sync.loading.loads import Loads
from torchrl_vllm_ext.weight_sync.loading.staging import headroom, staging_place
from torchrl_vllm_ext.weight_sync.transports.storage.slots import SlotReader

logger = logging.getLogger(__name__)

_WHERE = {
    "device": "on the device",
    "pinned": "in pinned host memory",
    "mapped": "not copied: the pause reads the storage slot",
}


class StorageReceiver:
    """The storage transport's part of a worker's weight sync (the worker extension's
    storage methods delegate here).

    Args:
        loads: the worker's shared staging and loading step.
    """

    def __init__(self, loads: Loads):
        self.loads = loads
        self.readers: dict[str, SlotReader] = {}
        """Storage root -> its reader (keeps the published slots mapped)."""

    def load_weights_from_storage(
        self, path: str, version: str | None = None, verified: bool = False
    ) -> str:
        """Read, verify and load the published slot of ``path``; returns the loaded version.

        ``verified=True`` skips the checksums: the replica actor on this host verified
        ``version`` just before the pause (``WeightSyncActorExtension.stage_storage``).
        """
        manifest, tensors = self._reader(path).read(version, verify=not verified)
        self.loads.load(tensors.items(), manifest.version)
        return manifest.version

    def apply_weights_from_storage(self, path: str, version: str) -> dict:
        """The pause call on CPUs: load the published slot ``version`` of ``path`` (the
        replica actor checksummed it before the pause); reports how it loaded:
        ``{"version", "path", "nbytes", "replayed_bytes", "why"}``."""
        manifest, tensors = self._reader(path).read(version, verify=False)
        report = self.loads.load(tensors.items(), manifest.version)
        return {"version": manifest.version, **report.as_dict()}

    def stage_weights_from_storage(self, path: str, version: str) -> str:
        """GPU workers: copy the published slot of ``path`` (checksummed by the replica
        actor) to this worker's GPU, or to pinned host memory when the GPU lacks room, in a
        background thread while the engine keeps generating; ``load_staged_weights``
        then copies it into the parameters in the pause. Where pinning a copy for each of
        the replica's workers would take more than half the host's free memory, nothing
        is copied (``mapped``): the pause reads the slot itself. Returns where it stages."""
        manifest, tensors = self._reader(path).read(version, verify=False)
        device = torch.device("cuda", torch.cuda.current_device())
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        worker = self.loads.worker
        area = self.loads.staging
        held_bytes = area.device_bytes()
        free, total = torch.cuda.mem_get_info(device)
        sleep_mode = bool(worker.vllm_config.model_config.enable_sleep_mode)
        # Each worker of a tensor-parallel replica stages the whole push (its loader
        # shards it): that many pinned copies on this host, at most.
        copies = worker.vllm_config.parallel_config.world_size
        pinned_held = area.nbytes if area.place == "pinned" else 0
        host_free = psutil.virtual_memory().available + pinned_held * copies
        place = staging_place(nbytes, free, total, held_bytes, sleep_mode, host_free, copies)
        if area.place != place:
            logger.info(
                "weight staging of %.2f GB: %s (GPU free %.2f of %.2f GB, headroom %.2f GB%s; "
                "host free %.1f GB for %d worker(s))",
                nbytes / 1e9,
                _WHERE[place],
                free / 1e9,
                total / 1e9,
                headroom(total) / 1e9,
                "; sleep mode keeps staging off the GPU" if sleep_mode else "",
                host_free / 1e9,
                copies,
            )
        if place == "mapped":
            area.release()  # a pinned copy of an earlier layout is of no use now
            self.loads.stage(manifest.version, lambda: list(tensors.items()))
        else:
            self.loads.stage(manifest.version, lambda: self.loads.copy_in(tensors, device, place))
        return place

    def release_weight_storage(self, path: str) -> bool:
        """Drop this worker's mappings of ``path`` (its scheme closed: the memory of the
        removed slots is freed once nobody maps them). The loaded weights are copies."""
        reader = self.readers.pop(path, None)
        if reader is not None:
            reader.close()
        return reader is not None

    def _reader(self, path: str) -> SlotReader:
        if path not in self.readers:
            self.readers[path] = SlotReader(path)
        return self.readers[path]
