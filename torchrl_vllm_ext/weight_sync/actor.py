"""The weight-sync actor extension: work done in a replica's Ray actor, beside its engine.

The replica instantiates it (``ServiceConfig.actor_extension_cls``) and runs its
public methods through ``VLLMReplica.extension_call`` (names in
:class:`torchrl_vllm_ext.protocol.ActorMethods`).
"""

from __future__ import annotations

import asyncio

from torchrl_vllm_ext.weight_sync.slots import SlotReader


class WeightSyncActorExtension:
    """Storage staging: checksum a published slot while the engine keeps generating.

    Examples:
        >>> ray.get(handle.extension_call.remote(ActorMethods.STAGE_STORAGE, (root, "3")))  # doctest: +SKIP
        '3'
    """

    def __init__(self):
        self._readers: dict[str, SlotReader] = {}  # storage root -> reader (keeps slots mapped)

    async def stage_storage(self, root: str, version: str) -> str:
        """Read and checksum the published slot ``version`` of ``root``; returns the version.

        Runs in the actor, not in the engine: a worker call would hold up the engine's
        steps. The workers then load it in the pause without checksumming it again.
        """
        reader = self._readers.setdefault(root, SlotReader(root))
        manifest, _ = await asyncio.to_thread(reader.read, version)
        return manifest.version

    async def release_storage(self, root: str) -> bool:
        """Drop the mappings of ``root`` (its scheme closed: its memory can be freed)."""
        reader = self._readers.pop(root, None)
        if reader is not None:
            reader.close()
        return reader is not None
