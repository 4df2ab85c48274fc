"""The storage transport's receiver (vLLM worker side): load the published slot, or stage
it on the GPU before the pause. Its sender: :mod:`.sender`; the replica actor's checksum
pass: :mod:`.actor`.

**Slice reads**: once a layout's load plan is traced, a worker reads of each tensor only
the views its plan copies (a tensor-parallel rank's shards, the experts it owns:
:func:`~torchrl_vllm_ext.weight_sync.loading.slices.slice_reads`), not the whole tensor:
a GPU worker stages only those views (the pause's replay reads nothing else); on CPUs the
pause replays the plan from the mapped slot, which reads only those views too. Tensors
the plan cannot slice (the loader computes from them, replicated ones) are read whole and
named in the report with the reason; a push with no plan (the first of a layout, plans
off, a refused plan) reads every tensor whole; a plan that no longer replays at the pause
(a parameter moved since staging) loads the slot's whole tensors. The value check is the
replica actor's checksum of the whole published slot, before the pause (:mod:`.actor`):
every slice a worker then reads lies in what it verified.
"""

from __future__ import annotations

import logging

import psutil
import torch

from torchrl_vllm_ext.weight_sync.loading.loads import Loads, Received
from torchrl_vllm_ext.weight_sync.loading.slices import SliceReads
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
        # The replay copies the plan's views straight out of the mapped slot.
        reads = self._reads(tensors, "cpu") if report.path == "replay" else None
        return {"version": manifest.version, **report.read_as(reads).as_dict()}

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
        whole = list(tensors.items())
        if place == "mapped":
            area.release()  # a pinned copy of an earlier layout is of no use now
            reads = self._reads(tensors, "cpu")  # the pause reads the slot's views
            self.loads.stage(manifest.version, lambda: Received(whole, reads=reads, whole=whole))
        else:
            # Only this worker's slices, once its plan says what they are.
            reads = self._reads(tensors, "cuda" if place == "device" else "cpu")
            slices = None if reads is None else reads.views

            def copy_slices() -> Received:
                named = self.loads.copy_in(tensors, device, place, slices)
                return Received(named, reads=reads, whole=whole if reads else None)

            self.loads.stage(manifest.version, copy_slices)
        return place

    def release_weight_storage(self, path: str) -> bool:
        """Drop this worker's mappings of ``path`` (its scheme closed: the memory of the
        removed slots is freed once nobody maps them). The loaded weights are copies."""
        reader = self.readers.pop(path, None)
        if reader is not None:
            reader.close()
        return reader is not None

    def _reads(self, tensors: dict[str, torch.Tensor], device_type: str) -> SliceReads | None:
        """What this worker reads of ``tensors`` once they are on ``device_type`` (the
        plan of that layout), or None (no plan yet: read whole)."""
        key = tuple(
            (n, tuple(t.shape), t.stride(), t.dtype, device_type) for n, t in tensors.items()
        )
        return self.loads.plans.reads(key)

    def _reader(self, path: str) -> SlotReader:
        if path not in self.readers:
            self.readers[path] = SlotReader(path)
        return self.readers[path]
