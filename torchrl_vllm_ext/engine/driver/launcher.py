"""ReplicaLauncher: the Ray side of one replica's start and stop.

What each replica reserves is planned once (:meth:`ReplicaLauncher.open`); a start then
places the replica (:mod:`~torchrl_vllm_ext.engine.placement`), reserves its placement
group, creates its actor from a :class:`~torchrl_vllm_ext.engine.replica.actor.ReplicaSpec`
and starts its engine, in its GPU's turn when replicas share a GPU
(:mod:`~torchrl_vllm_ext.engine.driver.start_order`); a stop shuts the engine down, kills
the actor and releases the placement group. A part of
:class:`~torchrl_vllm_ext.engine.driver.pool.ReplicaPool`, which keeps the records.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import ray

from torchrl_vllm_ext.engine import placement
from torchrl_vllm_ext.engine.calls import DEATH_ERRORS, actor_cause
from torchrl_vllm_ext.engine.config import ServiceConfig
from torchrl_vllm_ext.engine.driver import batch_invariance, cluster
from torchrl_vllm_ext.engine.driver.start_order import StartGates, orders_starts
from torchrl_vllm_ext.engine.replica.actor import (
    CONCURRENCY_GROUPS,
    WATCH_GROUP,
    ReplicaSpec,
    VLLMReplica,
)
from torchrl_vllm_ext.errors import ReplicaStartupError
from torchrl_vllm_ext.messages import ReplicaInfo

logger = logging.getLogger(__name__)


class ReplicaLauncher:
    """Starts and stops one replica's Ray actor and placement group.

    Args:
        config: the service's configuration.

    Examples:
        >>> from torchrl_vllm_ext.testing import make_tiny_model
        >>> launcher = ReplicaLauncher(ServiceConfig(model=make_tiny_model()))
        >>> launcher.uses_gpu, launcher.driver_ip  # before open(): nothing planned
        (False, None)
    """

    def __init__(self, config: ServiceConfig):
        self.config = config
        self._res: cluster.ReplicaResources | None = None
        self.driver_ip: str | None = None
        """The Ray node of the process that owns the service (set by :meth:`open`)."""
        # Replicas sharing a GPU: the first profiles it alone, the others start with the
        # KV-cache size it measured (engine/driver/start_order.py); kept for restarts.
        self.start_gates = StartGates()
        self._orders_starts = False

    async def open(self) -> None:
        """Plan what each replica reserves; call once, after Ray is connected."""
        self._res = cluster.plan_resources(self.config)
        batch_invariance.check(self._res.use_gpu, self.config)
        self.driver_ip = ray.util.get_node_ip_address()
        self._orders_starts = orders_starts(
            cluster.shares_gpus(self._res), cluster.engine_kwargs(self._res, self.config)
        )

    @property
    def uses_gpu(self) -> bool:
        return bool(self._res and self._res.use_gpu)

    def plan_nodes(
        self, count: int, in_use: Counter, avoid: frozenset[str] = frozenset()
    ) -> list[str | None]:
        """The node of each of ``count`` new replicas, by the configured placement
        (``in_use``: how many live replicas each node holds; ``avoid``: nodes to skip)."""
        if self.config.placement == "any":
            return [None] * count
        return placement.plan(
            self.config.placement, count, self._res.need(), cluster.live_nodes(), in_use, avoid
        )

    def check_capacity(self, count: int) -> None:
        """Refuse ``count`` more replicas than the cluster has room for now (a typed error
        naming what is missing)."""
        cluster.check_capacity(self._res, count, available=True)

    async def reserve(self, name: str, node: str | None) -> Any:
        """The placement group of replica ``name`` (on ``node`` if given)."""
        return await cluster.reserve(
            self._res, name, timeout=self.config.placement_timeout, node_ip=node
        )

    def create_actor(self, name: str, pg: Any, rid: int, weight_version: str) -> Any:
        """Replica ``rid``'s actor in ``pg``; its engine will start labelled
        ``weight_version`` (the checkpoint's label: it holds the checkpoint)."""
        return (
            ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(VLLMReplica)
            .options(**cluster.actor_options(self._res, name, pg))
            .remote(self._spec(rid, weight_version))
        )

    def _spec(self, rid: int, weight_version: str) -> ReplicaSpec:
        cfg, res = self.config, self._res
        return ReplicaSpec(
            replica_id=rid,
            model=cfg.model,
            engine_kwargs=cluster.engine_kwargs(res, cfg),
            weight_version=weight_version,
            env={**cluster.process_env(res, cfg), **batch_invariance.replica_env(cfg)},
            in_process=cluster.in_process_engine(res, cfg),
            actor_extension=cfg.actor_extension_cls,
            log_file=cfg.log_file,
            engine_cls=cfg.engine_cls,
        )

    async def start_engine(self, actor, rid: int) -> ReplicaInfo:
        """Start a replica's engine: at once, or in its GPU's turn when replicas share GPUs
        (:mod:`~torchrl_vllm_ext.engine.driver.start_order`: the first profiles alone, the
        others start with its KV-cache size; the startup timeout counts from the start).
        vLLM's own refusal is raised as its :class:`ReplicaStartupError`, not Ray's."""
        try:
            return await self._start_in_turn(actor, rid)
        except ray.exceptions.RayTaskError as e:
            cause = actor_cause(e)
            if isinstance(cause, ReplicaStartupError):
                raise cause from None  # the engine's own message, not Ray's traceback
            raise

    async def _start_in_turn(self, actor, rid: int) -> ReplicaInfo:
        def start(kv_cache_memory_bytes: int | None, report_kv_size: bool):
            ref = actor.start.remote(kv_cache_memory_bytes, report_kv_size)
            return asyncio.wait_for(ref, self.config.startup_timeout)

        if not self._orders_starts:
            return await start(None, False)
        return await self.start_gates.start(
            cluster.start_lock_key(await actor.visible_devices.remote()),
            rid,
            start,
            watch=lambda: actor.kv_cache_size.options(concurrency_group=WATCH_GROUP).remote(),
            prepare=lambda: actor.preload.remote(),
        )

    async def stop(self, rid: int, actor: Any, pg: Any, graceful: bool = True) -> None:
        """Shut replica ``rid``'s engine down (``graceful``), kill its actor, release its
        placement group."""
        if actor is not None and graceful:
            # A graceful engine shutdown also ends vLLM's child processes.
            try:
                await asyncio.wait_for(actor.shutdown.remote(), self.config.shutdown_timeout)
            except (TimeoutError, *DEATH_ERRORS) as e:
                logger.info("replica %d did not shut down gracefully (%s); killing it", rid, e)
        if actor is not None:
            # In a thread: killing a frozen (SIGSTOPped) actor takes Ray seconds, and the
            # event loop carries every other call meanwhile.
            await asyncio.to_thread(ray.kill, actor, no_restart=True)
        await asyncio.to_thread(cluster.release, pg)


__all__ = ["ReplicaLauncher"]
