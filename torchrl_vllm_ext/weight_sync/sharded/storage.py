"""A sharded push's storage step on every rank: write this rank's blocks straight into the
idle memory-mapped slot (no gather), then checksum the whole tensors this rank is given.

The slot is the storage transport's own A/B double buffer (:mod:`...storage.slots`):
rank 0's :class:`~...storage.slots.SlotWriter` allocates it in the file and, once every
rank's blocks are written and every tensor checksummed, publishes the manifest; until
then the replicas (and a restarted one) read the other slot, the published version.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tensordict import TensorDict

from torchrl_vllm_ext.errors import ShardedPushError
from torchrl_vllm_ext.weight_sync.params import checksum
from torchrl_vllm_ext.weight_sync.sharded.layout import Part, block
from torchrl_vllm_ext.weight_sync.transports.storage.slots import open_slot, slot_key


class SlotBlocks:
    """This rank's mappings of the slots it writes into (each mapped once, kept)."""

    def __init__(self, num_threads: int = 4):
        self.num_threads = num_threads
        self._maps: dict[str, TensorDict] = {}

    def slot(self, path: str, rank: int) -> TensorDict:
        td = self._maps.get(path)
        if td is None:
            if not (Path(path) / "meta.json").exists():
                raise ShardedPushError(
                    f"rank {rank} cannot open the storage slot {path}: it is on rank 0's "
                    "host. Ranks on other hosts need a directory every host shares: "
                    "WeightSyncScheme(service, transport='storage', storage_dir=SHARED_DIR).",
                    (rank,),
                )
            td = open_slot(path)
            self._maps[path] = td
        return td

    def write(self, path: str, rank: int, parts: list[tuple[Part, torch.Tensor]]) -> int:
        """Copy this rank's blocks (those it writes) into the slot at ``path``; the bytes
        written."""
        slot = self.slot(path, rank)
        mine = [(p, local) for p, local in parts if p.writes and p.numel]

        def put(item) -> int:
            part, local = item
            dst = block(slot.get(slot_key(part.name)), part.region)
            dst.copy_(local)
            return local.numel() * local.element_size()

        with ThreadPoolExecutor(self.num_threads) as pool:
            return sum(pool.map(put, mine))

    def checksums(self, path: str, rank: int, names: list[str]) -> dict[str, int]:
        """The checksum of each whole tensor ``names`` in the slot (after every rank wrote)."""
        slot = self.slot(path, rank)
        with ThreadPoolExecutor(self.num_threads) as pool:
            sums = pool.map(lambda n: checksum(slot.get(slot_key(n))), names)
            return dict(zip(names, sums, strict=True))

    def close(self) -> None:
        self._maps.clear()
