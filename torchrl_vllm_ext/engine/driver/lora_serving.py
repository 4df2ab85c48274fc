"""The LoRA adapters a :class:`~torchrl_vllm_ext.VLLMService` serves on every replica.

A client of the :class:`~torchrl_vllm_ext.engine.driver.pool.ReplicaPool` and a part of the
service, which exposes ``add_lora`` / ``add_lora_tensors`` / ``remove_lora`` under their
names (owner-only: a handle forwards them), over an
:class:`~torchrl_vllm_ext.engine.adapters.AdapterRegistry`.
A replica on the driver's node loads an adapter from its directory; a replica on another
node gets the directory's files through Ray's object store (one copy per adapter version),
unless the adapter's directory is shared by every node. An adapter from memory (a
trainer's tensors) is built by every replica's workers from its packed tensors, with no
file anywhere: a replica on the driver's node reads them from the driver's shared memory
when an :class:`~torchrl_vllm_ext.AdapterSync` packed them there (only the header crosses
Ray), any other from Ray's object store (one object per version, put once). A replica
started later gets the live adapters before it takes traffic (a step the pool runs
before marking it ready). Loading an adapter has a deadline
(:class:`~torchrl_vllm_ext.deadlines.Deadline` of the adapter's bytes): a replica that
does not answer in time is handled as dead (killed and restarted).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import ray

from torchrl_vllm_ext.deadlines import Deadline
from torchrl_vllm_ext.engine.adapters import (
    Adapter,
    AdapterRegistry,
    AdapterTensors,
    pack_adapter,
    read_files,
)
from torchrl_vllm_ext.engine.driver.pool import ReplicaPool
from torchrl_vllm_ext.engine.fleet import ReplicaView


class LoraServing:
    """Adapters on every replica of a pool.

    Args:
        pool: the replicas.
        adapters: the registry requests name adapters from.
        deadline: how long a replica may take to load an adapter (default
            :class:`~torchrl_vllm_ext.deadlines.Deadline`).
        on_change: called after every add or removal, whether it succeeded or not (the
            service publishes its live adapters to its handles).

    Examples:
        >>> from torchrl_vllm_ext.engine.config import ServiceConfig
        >>> from torchrl_vllm_ext.testing import make_tiny_model
        >>> pool = ReplicaPool(ServiceConfig(model=make_tiny_model()), "svc")
        >>> lora = LoraServing(pool, AdapterRegistry())
        >>> lora.live()
        {}
    """

    def __init__(
        self,
        pool: ReplicaPool,
        adapters: AdapterRegistry,
        deadline: Deadline | None = None,
        on_change: Callable[[], None] = lambda: None,
    ):
        self._pool = pool
        self._on_change = on_change
        self._adapters = adapters
        self._deadline = deadline or Deadline()
        # lora id -> its files (a directory's, for replicas on other nodes) or its packed
        # tensors (an adapter from memory, for every replica) in Ray's object store
        self._shipped: dict[int, asyncio.Future] = {}
        # lora id -> an adapter from memory, packed (in the driver's shared memory when an
        # AdapterSync packed it: replicas on this node read it there)
        self._packed: dict[int, AdapterTensors] = {}
        self._unmapped: set[str] = set()  # replica processes that cannot map that memory
        pool.admission.before_traffic(self._load_live)

    async def add_lora(self, name: str, path: str | Path, shared: bool = False) -> int:
        """Load the PEFT LoRA adapter in ``path`` on every replica as ``name``; returns
        vLLM's id for it. Re-adding a name loads the new files under a new id (requests
        already running finish on the old one). Needs ``enable_lora=True`` at launch.

        Replicas on other nodes than this process get the files through Ray's object
        store, unless ``shared`` says every node sees ``path`` (a shared file system).
        A replica that dies meanwhile gets the adapter when it restarts; if a replica
        refuses it, no replica keeps it and ``name`` serves what it served before.
        """
        try:
            adapter, previous = self._adapters.add(name, path, shared)
            return await self._add_everywhere(adapter, previous, _nbytes(Path(path)))
        finally:
            self._on_change()

    async def add_lora_tensors(
        self,
        name: str,
        tensors: dict | AdapterTensors,
        config: dict | None = None,
        version: str | int | None = None,
    ) -> int:
        """Load a LoRA adapter from memory on every replica as ``name``; returns vLLM's id
        for it. ``tensors``: PEFT's saved names -> tensors (``get_peft_model_state_dict``),
        ``config``: its ``LoraConfig`` as a dict; or both packed already
        (:class:`~torchrl_vllm_ext.engine.adapters.AdapterTensors`, no ``config``). No
        file is written: the tensors reach every replica, on any node, through Ray's
        object store, and its workers build the adapter from them. ``version``: also
        label every replica's weights ``version`` (as :meth:`set_weight_version`), each
        in the same call as its load (the pool's label follows once all do). Otherwise as
        :meth:`add_lora`.
        """
        try:
            label = None if version is None else str(version)
            return await self._add_tensors(name, tensors, config, label)
        finally:
            self._on_change()

    async def _add_tensors(
        self, name: str, tensors: dict | AdapterTensors, config: dict | None, version: str | None
    ) -> int:
        if not isinstance(tensors, AdapterTensors):
            tensors = await asyncio.to_thread(pack_adapter, tensors, config)
        elif tensors.shared is not None and tensors.shared.pid != os.getpid():
            tensors = dataclasses.replace(tensors, shared=None)  # a handle's process packed it
        shipped = None
        if tensors.shared is None:
            # In the object store first: the caller may reuse its buffer once this returns.
            shipped = asyncio.get_running_loop().create_future()
            shipped.set_result(await _put(tensors))
        adapter, previous = self._adapters.add(name, None, nbytes=tensors.data.nbytes)
        self._packed[adapter.lora_id] = tensors
        if shipped is not None:
            self._shipped[adapter.lora_id] = shipped
        return await self._add_everywhere(adapter, previous, adapter.nbytes, version)

    async def _add_everywhere(
        self, adapter: Adapter, previous: Adapter | None, nbytes: int, version: str | None = None
    ):
        limit = self._deadline.for_bytes(nbytes)
        label = self._pool.weight_version
        loads = await self._pool.call_each(
            lambda v: self._load(v, adapter, version), what="add_lora", deadline=limit
        )
        if loads.errors or (loads.dead and not loads.results):
            await self._unload(adapter)
            if version is not None:  # the replicas that took it keep their label
                took = [v for v in self._pool.ready() if v.replica_id in loads.results]
                await self._pool.call_all("set_weight_version", label, replicas=took)
            if previous is not None:
                self._adapters.put(previous)
            else:
                self._adapters.remove(adapter.name)
            loads.check(f"add_lora({adapter.name!r})")
        if version is not None:
            self._pool.admission.relabel(str(version))
        if previous is not None:
            await self._unload(previous)
        return adapter.lora_id

    async def remove_lora(self, name: str) -> None:
        """Unload adapter ``name`` from every replica (one from memory once the batches
        already using it ended)."""
        try:
            await self._unload(self._adapters.remove(name))
        finally:
            self._on_change()

    def live(self) -> dict[str, int]:
        """Live adapters: name -> vLLM id."""
        return {a.name: a.lora_id for a in self._adapters.live()}

    async def _load_live(self, replica: ReplicaView) -> None:
        for adapter in self._adapters.live():
            await self._load(replica, adapter)

    async def _load(
        self, replica: ReplicaView, adapter: Adapter, version: str | None = None
    ) -> str | int:
        """``add_lora`` on one replica, with the files when its node cannot read the path;
        ``add_lora_tensors`` with the packed tensors (and the label) for an adapter from
        memory."""
        if adapter.in_memory:
            packed = self._packed[adapter.lora_id]
            if (
                packed.shared is not None
                and replica.node == self._pool.launcher.driver_ip
                and replica.process not in self._unmapped
            ):  # the replica maps the driver's memory: only the header crosses Ray
                call = replica.handle.add_lora_tensors.remote(
                    adapter, packed.header_only(), version
                )
                loaded = await call
                if loaded is not None:
                    return loaded
                self._unmapped.add(replica.process)  # it may not: the object store then
            if adapter.lora_id not in self._shipped:  # one object per version, put once
                self._shipped[adapter.lora_id] = asyncio.ensure_future(
                    _put(dataclasses.replace(packed, shared=None))
                )
            packed = await self._shipped[adapter.lora_id]
            return await replica.handle.add_lora_tensors.remote(adapter, packed, version)
        if adapter.shared or replica.node == self._pool.launcher.driver_ip:
            return await replica.handle.add_lora.remote(adapter)
        if adapter.lora_id not in self._shipped:  # one read, one object per version
            self._shipped[adapter.lora_id] = asyncio.ensure_future(self._ship(adapter))
        return await replica.handle.add_lora.remote(adapter, await self._shipped[adapter.lora_id])

    @staticmethod
    async def _ship(adapter: Adapter) -> ray.ObjectRef:
        return await _put(await asyncio.to_thread(read_files, adapter))

    async def _unload(self, adapter: Adapter) -> None:
        self._shipped.pop(adapter.lora_id, None)
        self._packed.pop(adapter.lora_id, None)
        await self._pool.call_all("remove_lora", adapter.lora_id)


async def _put(value) -> ray.ObjectRef:
    """``value`` in Ray's object store (one object, however many replicas read it)."""
    return await asyncio.to_thread(ray.put, value)


def _nbytes(path: Path) -> int:
    """Bytes of the files of an adapter directory (0 if this host cannot read it)."""
    try:
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    except OSError:
        return 0


__all__ = ["LoraServing"]
