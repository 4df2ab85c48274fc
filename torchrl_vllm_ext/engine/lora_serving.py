"""The LoRA adapters a :class:`~torchrl_vllm_ext.VLLMService` serves on every replica.

A mixin of the service: ``add_lora`` / ``remove_lora`` / ``list_loras`` over the
service's :class:`~.adapters.AdapterRegistry`. A replica on the driver's node loads an
adapter from its directory; a replica on another node gets the directory's files
through Ray's object store (one copy per adapter version), unless the adapter's
directory is shared by every node. A replica started later gets the live adapters
before it takes traffic (``VLLMService._start_replica``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import ray

from torchrl_vllm_ext.engine import cluster
from torchrl_vllm_ext.engine.adapters import Adapter, read_files


class LoraServing:
    """``add_lora`` / ``remove_lora`` / ``list_loras`` of :class:`~torchrl_vllm_ext.VLLMService`."""

    def add_lora(self, name: str, path: str | Path, shared: bool = False) -> int:
        """Load the PEFT LoRA adapter in ``path`` on every replica as ``name``; returns
        vLLM's id for it. Re-adding a name loads the new files under a new id (requests
        already running finish on the old one). Needs ``enable_lora=True`` at launch.

        Replicas on other nodes than this process get the files through Ray's object
        store, unless ``shared`` says every node sees ``path`` (a shared file system).
        """
        return self.run(self._add_lora(name, path, shared))

    async def _add_lora(self, name: str, path, shared: bool) -> int:
        adapter, previous = self._adapters.add(name, path, shared)
        ready = [r for r in self._replicas.values() if r.state == "ready"]
        outcomes = await asyncio.gather(
            *(self._load_lora(r, adapter) for r in ready), return_exceptions=True
        )
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        if failed:  # no replica keeps it: the name serves what it served before
            await self._unload(adapter)
            if previous is not None:
                self._adapters.put(previous)
            else:
                self._adapters.remove(name)
            raise cluster.actor_cause(failed[0])
        if previous is not None:
            await self._unload(previous)
        return adapter.lora_id

    async def _load_lora(self, rep, adapter: Adapter) -> str:
        """``add_lora`` on one replica, with the files when its node cannot read the path."""
        if adapter.shared or rep.node in (None, self._driver_ip):
            return await rep.actor.add_lora.remote(adapter)
        if adapter.lora_id not in self._shipped:  # one read, one object per version
            self._shipped[adapter.lora_id] = asyncio.ensure_future(self._ship(adapter))
        return await rep.actor.add_lora.remote(adapter, await self._shipped[adapter.lora_id])

    @staticmethod
    async def _ship(adapter: Adapter) -> ray.ObjectRef:
        return ray.put(await asyncio.to_thread(read_files, adapter))

    def remove_lora(self, name: str) -> None:
        """Unload adapter ``name`` from every replica."""
        self.run(self.aremove_lora(name))

    async def aremove_lora(self, name: str) -> None:
        """Async :meth:`remove_lora` (on the service's loop)."""
        await self._unload(self._adapters.remove(name))

    async def _unload(self, adapter) -> None:
        self._shipped.pop(adapter.lora_id, None)
        ready = [r for r in self._replicas.values() if r.state == "ready"]
        await asyncio.gather(
            *(r.actor.remove_lora.remote(adapter.lora_id) for r in ready), return_exceptions=True
        )

    def list_loras(self) -> dict[str, int]:
        """Live adapters: name -> vLLM id."""
        return {a.name: a.lora_id for a in self._adapters.live()}
