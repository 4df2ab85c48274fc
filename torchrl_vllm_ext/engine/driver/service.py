"""VLLMService: N vLLM replicas on Ray behind one object, a facade over named parts.

* :class:`~.pool.ReplicaPool`: the replicas' lifecycle, the ready snapshot, fan-out calls
  and the one death policy;
* :class:`~.generate_calls.GenerateCalls` over :class:`~.generation.Generation`: the
  generate calls (validate, route, send, retry, merge) and the tokenizer;
* :class:`~.lora_serving.LoraServing`: the adapters on every replica;
* :class:`~.control.FleetView`, :class:`~.control.Control` and
  :class:`~.torchrl_engine.TorchRLEngine`: snapshot readers, control calls, TorchRL's
  engine calls.

The service's public methods are its parts' (:func:`~torchrl_vllm_ext.engine.handles.owner.delegate`,
one line per part). All of their state lives on one private event loop
(:class:`~.loop.LoopThread`): the sync methods block on it and the ``a``-prefixed ones
await it (both made from one coroutine,
:func:`~torchrl_vllm_ext.engine.handles.owner.delegate_sync_and_async`). Readers of the
ready snapshot (``replica_ids``, ``replica_info``, ...) run on the caller's thread.

The service pickles, as TorchRL's ``AsyncVLLM`` does: in another Ray process it is a
handle to the same replicas (:mod:`~torchrl_vllm_ext.engine.handles.directory`, :class:`~torchrl_vllm_ext.engine.handles.pool.HandlePool`). A
handle generates and scores through them, sees the owner's weight version and deaths, and
forwards what only the owner does (:func:`~torchrl_vllm_ext.engine.handles.owner.owner_only`: pushes, pause, replicas,
adapters); closing a handle stops nothing.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import ray

from torchrl_vllm_ext import leftovers
from torchrl_vllm_ext._compat import vllm_engine_api
from torchrl_vllm_ext.engine.adapters import AdapterRegistry
from torchrl_vllm_ext.engine.config import ServiceConfig
from torchrl_vllm_ext.engine.driver import cluster
from torchrl_vllm_ext.engine.driver.control import (
    CONTROL,
    FLEET_VIEW,
    OWNER_CONTROL,
    Control,
    FleetView,
)
from torchrl_vllm_ext.engine.driver.generate_calls import GENERATE_CALLS, READERS, GenerateCalls
from torchrl_vllm_ext.engine.driver.generation import Generation
from torchrl_vllm_ext.engine.driver.loop import LoopThread
from torchrl_vllm_ext.engine.driver.lora_serving import LoraServing
from torchrl_vllm_ext.engine.driver.pool import ReplicaPool
from torchrl_vllm_ext.engine.driver.torchrl_engine import (
    ENGINE_CALLS,
    OWNER_ENGINE_CALLS,
    TorchRLEngine,
    actor_style,
    from_pretrained_kwargs,
    register_engine,
    register_engine_if_loaded,
)
from torchrl_vllm_ext.engine.fleet import WeightsProvider
from torchrl_vllm_ext.engine.handles import links
from torchrl_vllm_ext.engine.handles.owner import (
    add_deprecated_aliases,
    close_at_exit,
    delegate,
    delegate_sync_and_async,
    owner_only,
)
from torchrl_vllm_ext.engine.handles.pool import HandlePool
from torchrl_vllm_ext.errors import ConfigurationError, ServiceClosedError

T = TypeVar("T")


class VLLMService:
    """vLLM v1 engine replicas as Ray actors behind one object.

    Use :meth:`launch` (or :meth:`from_config`); shut down with :meth:`shutdown` or a
    ``with`` block, which releases every actor and placement group. Pickled into another
    Ray process (a Ray actor, a task), it is a handle to the same replicas.

    Examples:
        >>> from torchrl_vllm_ext import VLLMService
        >>> from torchrl_vllm_ext.testing import make_tiny_model
        >>> with VLLMService.launch(make_tiny_model(), num_replicas=1) as svc:  # doctest: +SKIP
        ...     outs = svc.generate([[1, 2, 3]], {"max_tokens": 8})
        ...     len(outs[0].outputs[0].token_ids)
        8
    """

    def __init__(
        self,
        config: ServiceConfig,
        pool: ReplicaPool | HandlePool | None = None,
        name: str | None = None,
    ):
        self.config = config
        self.name = name or f"tvllm-{uuid.uuid4().hex[:8]}"
        """Unique per service object (a handle's too): the prefix of its request ids."""
        self._loop = LoopThread(self.name)
        self.pool = pool if pool is not None else ReplicaPool(config, self.name)
        """The replicas (what weight-sync transports are given)."""
        self._adapters = AdapterRegistry()
        generation = Generation(self.pool, self._adapters, self.name)
        self._generate_calls = GenerateCalls(generation, config, self.name)
        self._lora = (
            LoraServing(self.pool, self._adapters, on_change=self._publish)
            if self.is_owner
            else None
        )
        # The owner's OwnerLink (directory, mailbox, port) or a handle's HandleLink.
        self._link: links.OwnerLink | links.HandleLink | None = None
        self._owns_ray = False
        self._closed = False
        self._view = FleetView(self.pool)
        self._control = Control(self.pool, config, self.run)
        self._torchrl = TorchRLEngine(self)

    @property
    def is_owner(self) -> bool:
        """True in the process that launched the service; False in a handle."""
        return not isinstance(self.pool, HandlePool)

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def launch(
        cls,
        model_path: str | Path,
        num_replicas: int = 1,
        tensor_parallel_size: int = 1,
        ray_address: str | None = None,
        **kwargs: Any,
    ) -> VLLMService:
        """Start ``num_replicas`` engines on ``model_path`` and return the running service.

        Keywords that are :class:`~torchrl_vllm_ext.engine.config.ServiceConfig` fields
        (``routing``, ``cpus_per_replica``, ``startup_timeout``, ``weight_version``, ...)
        configure the service; every other one goes to ``vllm.AsyncEngineArgs``
        (``max_model_len``, ``dtype``, ``enforce_eager``, ``seed``, ...). If any replica
        fails to start, everything already started is released before the error
        propagates.
        """
        config = ServiceConfig.from_kwargs(
            model_path,
            num_replicas=num_replicas,
            tensor_parallel_size=tensor_parallel_size,
            ray_address=ray_address,
            **kwargs,
        )
        return cls.from_config(config)

    @classmethod
    def from_pretrained(cls, model_name: str | Path, num_replicas: int = 1, **kwargs: Any):
        """TorchRL's ``AsyncVLLM.from_pretrained(model_name, num_devices=None, num_replicas=1,
        verbose=True, compile=True, enable_fp32_output=False, **engine_kwargs)``, same
        keywords (see :func:`~.torchrl_engine.from_pretrained_kwargs`): the one line a
        TorchRL script changes."""
        return cls.launch(model_name, num_replicas, **from_pretrained_kwargs(**kwargs))

    @classmethod
    def from_config(cls, config: ServiceConfig) -> VLLMService:
        """Start the replicas ``config`` describes and return the running service."""
        leftovers.reap()  # what killed services, schemes and replicas left on this host
        svc = cls(config)
        try:
            # Ray is joined from the caller's thread: it installs signal handlers there.
            svc._owns_ray = cluster.ensure_ray(
                config.ray_address, log_to_driver=config.log_file is None
            )
            svc._link = links.OwnerLink(svc.name, functools.partial(links.serve, svc))
            svc.pool.records.on_publish(svc._publish)
            svc._loop.run(svc._launch())
        except BaseException:
            svc.shutdown()
            raise
        close_at_exit(svc)
        return svc

    async def _launch(self) -> None:
        await self.pool.open()
        # The driver's first vLLM import (SamplingParams: seconds) runs while the
        # replicas start, not at the first request.
        importing = asyncio.ensure_future(asyncio.to_thread(_driver_imports))
        await self.pool.start(self.config.num_replicas, "starting vLLM replicas")
        await importing
        self.pool.health.start()

    def follow(self, link, adapters) -> None:
        """A handle's set-up (``links.attach``): owner-only calls go through ``link``
        (a ``HandleLink``); serve ``adapters`` and every change the owner publishes."""
        self._link = link
        self._adapters.replace(adapters)
        self.pool.on_adapters(self._adapters.replace)

    @property
    def closed(self) -> bool:
        """Whether :meth:`shutdown` ran (or the process's exit closed it)."""
        return self._closed

    def close_after_ray(self) -> None:
        """At exit, when Ray was shut down first (its replicas were killed with it): mark
        the service closed and remove their temporary directories once they are gone."""
        self._closed = True
        leftovers.reap_when_gone(self.pool.records.temp_dirs())

    @property
    def reserved_port(self) -> int:
        """The TCP port the owner reserved at launch and holds until it shuts down."""
        if not isinstance(self._link, links.OwnerLink):
            raise ServiceClosedError(
                f"service {self.name}: only the process that launched it holds its port."
            )
        return self._link.port.port

    def shutdown(self) -> None:
        """The owner stops every replica and releases its actor, placement group and port;
        a handle only stops following them. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._torchrl.close()
            self._loop.run(self.pool.close(), timeout=300)
        finally:
            self._loop.close()
            if self.is_owner:
                self._close_owned()

    def _close_owned(self) -> None:
        try:
            if self._link is not None:
                self._link.close(self.pool, self._adapters.live())
        finally:
            if self._owns_ray and ray.is_initialized():
                ray.shutdown()

    def __enter__(self) -> VLLMService:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    async def __aenter__(self) -> VLLMService:
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.shutdown)

    # ------------------------------------------------------------------ owner and handles
    def __reduce__(self):
        if self._closed or self._link is None:
            raise ServiceClosedError(f"service {self.name} is not running; nothing to pickle.")
        if self.is_owner:
            table = self._link.table(self.pool, self._adapters.live())
        else:
            table = self.pool.table
        owner = self.name.split("-h")[0]
        return _attach, (self.config, self._link.directory, table, owner)

    def _publish(self) -> None:
        """Mirror the pool's state to the handles' directory (after every change)."""
        self._link.publish(self.pool, self._adapters.live())

    def export(self, method) -> str:
        """Let handles call the bound ``method`` through :meth:`call_exported` (the owner
        holds it weakly); returns its key. A weight-sync updater shipped into a Ray actor
        exports its scheme's ``push`` this way."""
        self._require_owner("export")
        return self._link.export(method)

    @owner_only
    def call_exported(self, key: str, *args, **kwargs):
        """Call what :meth:`export` returned ``key`` for (from a handle: on the owner)."""
        return self._link.exported(key)(*args, **kwargs)

    def _forward(self, name: str, args: tuple, kwargs: dict):
        """Owner-only method ``name``, run by the owner (this is a handle)."""
        return self._link.forward(name, args, kwargs)

    # ------------------------------------------------------------------ generation and LoRA
    # GenerateCalls (generate, generate_request_data, generate_request_batch, the tokenizer)
    # and LoraServing (add_lora, add_lora_tensors, remove_lora) are parts: their coroutines
    # are the service's blocking methods and a-prefixed forms (see below).
    def list_loras(self) -> dict[str, int]:
        """Live adapters: name -> vLLM id."""
        return {a.name: a.lora_id for a in self._adapters.live()}

    # ------------------------------------------------------------------ replicas and control
    # FleetView (snapshot readers), Control (calls on every replica) and TorchRLEngine
    # (AsyncVLLM's engine calls) are parts: their methods are the service's (see below).
    def set_weights_provider(self, provider: WeightsProvider | None) -> None:
        """Make ``provider`` bring restarted replicas to the live weights (None: nobody).

        A weight-sync scheme sets itself after each push it completes (on the owner); a
        provider with a version also brings the held replicas to it.
        """
        self._require_owner("set_weights_provider")

        async def provide() -> None:  # on the loop: it may start the held replicas' bring-up
            self.pool.set_provider(provider)

        self.run(provide())

    def _require_owner(self, what: str) -> None:
        if not self.is_owner:
            raise ConfigurationError(
                f"{what} needs the service's owner (the process that launched it); this is a "
                "handle in another process: push with WeightSyncUpdater, vLLMUpdaterV2 or "
                "service.update_weights (forwarded to the owner), or from the owner."
            )

    # ------------------------------------------------------------------ the event loop
    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the service's event loop, where replicas are managed, and block.

        Weight-sync schemes run their pushes here, so a push and a replica restart share
        one event loop and one lock.
        """
        return self._loop.run(self._open(coro))

    async def arun(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on the service's event loop (from any event loop)."""
        return await self._loop.arun(self._open(coro))

    def submit(self, coro: Coroutine[Any, Any, T]):
        """Schedule ``coro`` on the service's event loop; a ``concurrent.futures.Future``."""
        return asyncio.run_coroutine_threadsafe(self._open(coro), self._loop.loop)

    def _open(self, coro: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
        """``coro``, or :class:`ServiceClosedError` (closing ``coro``) after shutdown."""
        if self._closed:
            coro.close()
            raise ServiceClosedError(f"service {self.name} was shut down; launch a new one.")
        return coro


delegate(VLLMService, "_view", FleetView, FLEET_VIEW)
delegate(VLLMService, "_control", Control, CONTROL)
delegate(VLLMService, "_control", Control, OWNER_CONTROL, owner=True)
delegate_sync_and_async(VLLMService, "_control", Control, ["set_weight_version"], owner=True)
delegate(VLLMService, "_generate_calls", GenerateCalls, READERS)
delegate_sync_and_async(VLLMService, "_generate_calls", GenerateCalls, GENERATE_CALLS)
delegate_sync_and_async(
    VLLMService,
    "_lora",
    LoraServing,
    ["add_lora", "add_lora_tensors"],
    owner=True,
    async_forms=False,
)
delegate_sync_and_async(VLLMService, "_lora", LoraServing, ["remove_lora"], owner=True)
delegate(VLLMService, "_torchrl", TorchRLEngine, ENGINE_CALLS)
delegate(VLLMService, "_torchrl", TorchRLEngine, OWNER_ENGINE_CALLS, owner=True)
# Ray-actor style (``.remote(...)``): what TorchRL's vLLMWrapper and vLLMUpdater call.
VLLMService.generate = actor_style(VLLMService.generate)
VLLMService.collective_rpc = actor_style(VLLMService.collective_rpc)
add_deprecated_aliases(VLLMService)
register_engine_if_loaded(VLLMService)


def _attach(config: ServiceConfig, directory_actor, table, owner: str) -> VLLMService:
    register_engine_if_loaded(VLLMService)
    return links.attach(VLLMService, config, directory_actor, table, owner)


def _driver_imports() -> None:
    # One thread, one after the other: TorchRL's module imports vLLM too, and two threads
    # importing one package at once can see it half initialised.
    vllm_engine_api()
    register_engine(VLLMService)  # TorchRL's engine ABC, for vLLMUpdaterV2(service)


__all__ = ["VLLMService"]
