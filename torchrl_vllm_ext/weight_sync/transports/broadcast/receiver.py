"""The broadcast transport's receiver (vLLM worker side): join the trainer's process group,
receive and verify the buckets (in a background thread before the pause, or at once for a
restarted replica). Its sender: :mod:`.sender`."""

from __future__ import annotations

import logging

import torch

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.weight_sync.loading.loads import Loads
from torchrl_vllm_ext.weight_sync.params import device_checksums
from torchrl_vllm_ext.weight_sync.specs import UpdateHeader, from_json
from torchrl_vllm_ext.weight_sync.transports.broadcast.collective import (
    end_group,
    make_process_group,
)
from torchrl_vllm_ext.weight_sync.transports.packing import unpack

logger = logging.getLogger(__name__)


class BroadcastReceiver:
    """The broadcast transport's part of a worker's weight sync (the worker extension's
    broadcast methods delegate here).

    Args:
        loads: the worker's shared staging and loading step.
    """

    def __init__(self, loads: Loads):
        self.loads = loads
        self.group: tuple | None = None
        """``(store, process group)`` this worker joined, if any."""
        self.backend: str | None = None
        self.device: torch.device | None = None
        """Where buckets are received (the worker's GPU for NCCL, else the CPU)."""
        self.buffers: list[torch.Tensor] = []
        """Receive buffers kept from push to push (one per bucket)."""

    def init_weight_broadcast(
        self,
        host: str,
        port: int,
        world_size: int,
        rank_offset: int,
        backend: str,
        timeout_s: float,
    ) -> int:
        """Join the trainer's broadcast group; returns this worker's rank in it."""
        self.close_weight_broadcast()
        rank = rank_offset + self.loads.worker.rank
        self.group = make_process_group(backend, host, port, world_size, rank, timeout_s)
        self.backend = backend
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        return rank

    def receive_weight_broadcast(self, header_json: str) -> str:
        """Receive every bucket of one update, verify all, then load; returns the version."""
        header = from_json(header_json, UpdateHeader)
        self.loads.load(self._receive(header), header.version)
        return header.version

    def stage_weight_broadcast(self, header_json: str) -> bool:
        """Receive and verify one update in a background thread (before the pause)."""
        header = from_json(header_json, UpdateHeader)
        return self.loads.stage(header.version, lambda: self._receive(header))

    def _receive(self, header: UpdateHeader) -> list[tuple[str, torch.Tensor]]:
        group = self.group
        if group is None:
            raise WeightSyncError(
                "this worker is not in a broadcast group; call init_weight_broadcast first."
            )
        received = []
        sums = None
        for i, bucket in enumerate(header.buckets):
            buf = _buffer(self.buffers, i, bucket.nbytes, self.device)
            try:
                group[1].broadcast(buf, 0).wait()
                if header.checksums_follow and i == len(header.buckets) - 1:
                    sums = torch.empty(len(header.buckets), dtype=torch.int64, device=self.device)
                    group[1].broadcast(sums, 0).wait()
            except Exception as e:  # the trainer died or stalled past the group's timeout
                # The group is unusable now; the next push forms a new one.
                if self.group is group:
                    self.group = None
                    end_group(self.backend, group[1])
                error = WeightSyncError(
                    f"broadcast of weight version {header.version} was cut off after "
                    f"{len(received)} of {len(header.buckets)} buckets ({type(e).__name__}: "
                    f"{e}); nothing was loaded, this worker keeps serving its previous weights. "
                    "Push again: the next push forms a new group."
                )
                logger.error("%s", error)
                raise error from e
            received.append((bucket, buf))
        # on the GPU for NCCL (no copy to the host), one sync for all buckets
        got_sums = device_checksums([buf for _, buf in received])
        if sums is None:
            sent = [bucket.checksum for bucket, _ in received]
        else:  # the sender's int64 words of the uint64 sums
            sent = [s % (1 << 64) for s in sums.tolist()]
        for i, (got, want) in enumerate(zip(got_sums, sent, strict=True)):
            if got != want:
                raise WeightSyncError(
                    f"bucket {i} of version {header.version} arrived corrupted (checksum {got} != "
                    f"{want}); nothing was loaded."
                )
        # Loaded in one reload: vLLM re-processes a layer once all its weights arrived.
        return [item for bucket, buf in received for item in unpack(bucket, buf)]

    def close_weight_broadcast(self) -> bool:
        """Leave the group (an NCCL one aborted: a receive stuck on a dead member ends)
        and drop the receive buffers; whether it was in one."""
        group, self.group = self.group, None
        if group is not None:
            end_group(self.backend, group[1])
        self.buffers = []
        return group is not None


def _buffer(kept: list[torch.Tensor], i: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """The receive buffer of bucket ``i``: the one kept from the last push when it has the
    size and device, else a new one (kept in its place). The load in the pause is done
    with it before the next push receives."""
    if i < len(kept) and kept[i].numel() == nbytes and kept[i].device == device:
        return kept[i]
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if i < len(kept):
        kept[i] = buf
    else:
        kept.append(buf)
    return buf
