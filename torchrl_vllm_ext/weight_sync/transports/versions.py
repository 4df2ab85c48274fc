"""A packed transport's buckets by version: the push in flight and the version the replicas
serve, in two sets of buffers re-packed in place (broadcast, ipc and auto each hold one).

A push packs into the set the committed version is not in, stages what the replicas
received, then commits it (the staged buckets become the committed ones: restarted
replicas are brought up from them, a delta push changes them) or rolls back (the
committed buckets stay as they were). The same buffers serve push after push: CUDA IPC
receivers keep their mappings and no new handles are opened; a new layout allocates anew.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchrl_vllm_ext.weight_sync.transports.packing import DEFAULT_BUCKET_BYTES, Packed, pack


class PackedVersions:
    """The staged and committed buckets of one sender, packed into two sets (A and B) of
    buffers: the committed version's set stays intact while the other takes the next push.

    Where memory does not allow two sets (``keep_spare``, by default :func:`keeps_spare`),
    the spare is dropped at :meth:`commit` and the next push allocates one.

    Args:
        keep_spare: ``(nbytes, device) -> bool``: whether a second set of ``nbytes`` may
            stay allocated on ``device`` between pushes.

    Examples:
        >>> versions = PackedVersions()
        >>> a = versions.pack({"w": torch.ones(2)}, "1")
        >>> versions.stage(a); versions.commit()
        >>> b = versions.pack({"w": torch.ones(2)}, "2")  # a is live: the other set
        >>> versions.stage(b); versions.commit()
        >>> c = versions.pack({"w": torch.ones(2)}, "3")  # a's buffers again
        >>> b.buffers is a.buffers, c.buffers is a.buffers, versions.committed.version
        (False, True, '2')
        >>> versions.rollback(); versions.committed.version  # c was never staged
        '2'
    """

    def __init__(self, keep_spare: Callable[[int, torch.device], bool] | None = None):
        self.staged: Packed | None = None
        """The buckets of the push in flight (None: none, or a push that keeps no copy
        here)."""
        self.committed: Packed | None = None
        """The buckets of the version the replicas serve (restarts; a delta's base)."""
        self._sets: list[Packed] = []
        self._keep_spare = keep_spare or keeps_spare

    def pack(
        self,
        tensors: dict[str, torch.Tensor],
        version: str,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        dtype: torch.dtype | None = None,
        checksums: bool = True,
    ) -> Packed:
        """``tensors`` packed (cast to ``dtype`` if given; ``checksums=False``: left 0, see
        :func:`~.packing.pack`) into the set that is not the committed version's (reused
        when it fits)."""
        committed = self.committed
        live = [p for p in self._sets if committed is not None and p.buffers is committed.buffers]
        spare = next((p for p in self._sets if not any(p is q for q in live)), None)
        packed = pack(tensors, version, bucket_bytes, spare, dtype, checksums)
        self._sets = [*live, packed]
        return packed

    def stage(self, packed: Packed | None) -> None:
        """``packed`` is the push in flight (None: the push keeps no copy here, so after
        its commit a restarted replica waits for the next push)."""
        self.staged = packed

    def commit(self) -> None:
        """The replicas serve the staged version: it becomes the committed one; the spare
        set is kept only where memory allows."""
        self.committed, self.staged = self.staged, None
        committed = self.committed
        if committed is None or not committed.buffers:
            return
        if not self._keep_spare(committed.nbytes, committed.buffers[0].device):
            self._sets = [p for p in self._sets if p.buffers is committed.buffers]

    def rollback(self) -> None:
        """No replica loaded the staged version: the committed one stays."""
        self.staged = None

    def clear(self) -> None:
        """Drop every set (the sender closes)."""
        self.staged = self.committed = None
        self._sets = []


def keeps_spare(nbytes: int, device: torch.device) -> bool:
    """Whether a second set of ``nbytes`` of buckets may stay allocated on ``device``
    between pushes: always in host memory; on a GPU when it keeps the staging headroom
    free (:func:`~torchrl_vllm_ext.weight_sync.loading.staging.headroom`: the trainer
    trains there)."""
    if device.type != "cuda":
        return True
    from torchrl_vllm_ext.weight_sync.loading.staging import headroom

    free, total = torch.cuda.mem_get_info(device)
    return free >= headroom(total)
