"""The storage transport's part in the replica's Ray actor: checksum a published slot while
the engine keeps generating (a worker call would hold up the engine's steps)."""

from __future__ import annotations

import asyncio

from torchrl_vllm_ext.weight_sync.transports.storage.slots import SlotReader


class StorageActor:
    """Actor methods of the storage transport (:class:`torchrl_vllm_ext.extensions.ActorMethods`).

    Examples:
        >>> ray.get(handle.extension_call.remote(ActorMethods.STAGE_STORAGE, (root, "3")))  # doctest: +SKIP
        '3'
    """

    def _storage_readers(self) -> dict[str, SlotReader]:
        """Storage root -> its reader (keeps the slots mapped)."""
        return self.__dict__.setdefault("storage_readers", {})

    async def stage_storage(self, root: str, version: str) -> str:
        """Read and checksum the published slot ``version`` of ``root``; returns the version.

        The workers then load it in the pause without checksumming it again.
        """
        reader = self._storage_readers().setdefault(root, SlotReader(root))
        manifest, _ = await asyncio.to_thread(reader.read, version)
        return manifest.version

    async def release_storage(self, root: str) -> bool:
        """Drop the mappings of ``root`` (its scheme closed: its memory can be freed)."""
        reader = self._storage_readers().pop(root, None)
        if reader is not None:
            reader.close()
        return reader is not None
