"""ReplicaPool: the replicas of one service, their lifecycle, and one way to call them.

The pool owns the replica records (state as :class:`ReplicaState`), start / stop /
restart / health checks, placement, and an immutable snapshot of the ready replicas
(:meth:`ReplicaPool.ready`) that any thread may read. Every call to replicas goes
through :meth:`ReplicaPool.call_each` (or :meth:`~ReplicaPool.call_all` /
:meth:`~ReplicaPool.call`), which applies the one death policy:

    a replica that dies during a call is recorded (:meth:`ReplicaPool.deaths`),
    restarted in the background at the live weights, and reported to the caller as a
    :class:`~torchrl_vllm_ext.errors.ReplicaDeadError` naming it; the other replicas'
    answers are kept. A call made with a ``deadline`` treats a replica that does not
    answer in time (frozen, hung in a collective) the same way: it is killed, recorded
    and restarted.

Everything except the snapshot readers runs on the service's event loop. Generation,
LoRA serving and the weight-sync transports are clients of the pool; a transport sees
it through the narrow :class:`ReplicaFleet` protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import ray
from tqdm.auto import tqdm

from torchrl_vllm_ext.engine import placement
from torchrl_vllm_ext.engine.calls import DEATH_ERRORS, Outcomes, ReplicaCalls, actor_cause
from torchrl_vllm_ext.engine.config import ServiceConfig
from torchrl_vllm_ext.engine.driver import batch_invariance, cluster
from torchrl_vllm_ext.engine.driver.start_order import StartGates, orders_starts
from torchrl_vllm_ext.engine.fleet import ReplicaFleet, ReplicaState, ReplicaView, WeightsProvider
from torchrl_vllm_ext.engine.labels import WeightLabels, held_refusal
from torchrl_vllm_ext.engine.replica.actor import (
    CONCURRENCY_GROUPS,
    WATCH_GROUP,
    ReplicaSpec,
    VLLMReplica,
)
from torchrl_vllm_ext.engine.serving import ServingState, restart_steps
from torchrl_vllm_ext.errors import (
    NoHealthyReplicaError,
    ReplicaDeadError,
    ReplicaStartupError,
)
from torchrl_vllm_ext.messages import ReplicaDeath, ReplicaInfo

logger = logging.getLogger(__name__)


BringUpStep = Callable[[ReplicaView], Awaitable[Any]]
ServingHook = Callable[[tuple[ReplicaView, ...]], Awaitable[Any]]


@dataclass
class _Record:
    """A replica's mutable record (touched on the event loop only)."""

    replica_id: int
    pg: Any
    node: str | None = None  # planned, then the node it reported
    actor: Any = None
    info: ReplicaInfo | None = None
    state: ReplicaState = ReplicaState.STARTING
    inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    owned: bool = True  # started by the pool, which stops it (see ReplicaPool.adopt)
    holds: str | None = None  # the version a started replica loaded (None: the checkpoint)

    def view(self) -> ReplicaView:
        return ReplicaView(self.replica_id, self.actor, self.info)


class ReplicaPool(ReplicaCalls):
    """The replicas of one service: lifecycle, snapshot, fan-out, death policy.

    Args:
        config: the service's configuration.
        name: prefix of the replicas' Ray names.

    Examples:
        >>> from torchrl_vllm_ext.testing import make_tiny_model
        >>> pool = ReplicaPool(ServiceConfig(model=make_tiny_model()), "svc")
        >>> pool.ready(), dict(pool.states()), pool.weight_version
        ((), {}, '0')
    """

    def __init__(self, config: ServiceConfig, name: str):
        self.config = config
        self.name = name
        self._records: dict[int, _Record] = {}
        self._ready: tuple[ReplicaView, ...] = ()
        self._states: Mapping[int, ReplicaState] = MappingProxyType({})
        self._ids = itertools.count()
        self._res: cluster.ReplicaResources | None = None
        self._driver_ip: str | None = None
        self._limits: ReplicaInfo | None = None
        self._deaths: deque[ReplicaDeath] = deque(maxlen=1000)
        self._death_listeners: list[Callable[[int], None]] = []
        self._bring_up_steps: list[BringUpStep] = []
        self._serving_hooks: list[ServingHook] = []
        # Replicas sharing a GPU: the first profiles it alone, the others start with the
        # KV-cache size it measured (engine/driver/start_order.py); kept for restarts.
        self.start_gates = StartGates()
        self._orders_starts = False
        self._tasks: set[asyncio.Task] = set()
        self._restarting: set[int] = set()  # ids between their death and their restart
        self._closed = False
        self._publish_listeners: list[Callable[[], None]] = []
        self.labels = WeightLabels.at_launch(config.weight_version)
        """The live version, the checkpoint's label, and which weights the live one names
        (:mod:`~torchrl_vllm_ext.engine.labels`): what a started replica holds and serves."""
        self.provider: WeightsProvider | None = None
        """Brings started replicas to the live weights (the scheme that pushed last)."""
        self.serving = ServingState()
        """The service's pause and sleep: a restarted replica is brought to the same state
        before it counts as ready (:func:`~torchrl_vllm_ext.engine.serving.restart_steps`)."""

    # ------------------------------------------------------------------ snapshot (any thread)
    @property
    def weight_version(self) -> str:
        """The weights every ready replica serves (``allow_mixed_versions`` aside), and
        restarted replicas are brought to."""
        return self.labels.live

    def ready(self) -> tuple[ReplicaView, ...]:
        """The ready replicas, by id; an immutable snapshot any thread may read."""
        return self._ready

    def temp_dirs(self) -> list[str]:
        """The temporary directories of the replicas this pool started (for an exit after
        Ray was shut down under the service: see ``VLLMService``'s exit hook)."""
        return [r.info.temp_dir for r in list(self._records.values()) if r.owned and r.info]

    def states(self) -> Mapping[int, ReplicaState]:
        """Every replica the pool holds and its state; an immutable snapshot."""
        return self._states

    def view(self, replica_id: int) -> ReplicaView:
        """The ready replica ``replica_id``; :class:`ReplicaDeadError` if it is not ready."""
        for view in self._ready:
            if view.replica_id == replica_id:
                return view
        state = self._states.get(replica_id)
        raise ReplicaDeadError(
            f"replica {replica_id} is not ready (state: "
            f"{state.value if state else 'unknown'}); ready replicas: "
            f"{[v.replica_id for v in self._ready]}."
        )

    def deaths(self) -> list[ReplicaDeath]:
        """Every replica death the pool noticed, oldest first (each is then restarted)."""
        return list(self._deaths)

    @property
    def limits(self) -> ReplicaInfo | None:
        """The first replica's limits (every replica serves the same model)."""
        return self._limits

    @property
    def uses_gpu(self) -> bool:
        return bool(self._res and self._res.use_gpu)

    @property
    def workers_per_replica(self) -> int:
        return self.config.tensor_parallel_size * self.config.pipeline_parallel_size

    @property
    def driver_ip(self) -> str | None:
        """The Ray node of the process that owns the service."""
        return self._driver_ip

    # ------------------------------------------------------------------ hooks
    def on_publish(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (on the loop) after every change of the snapshots, the deaths
        or the weight version (the service mirrors them to its handles' directory)."""
        self._publish_listeners.append(listener)

    def on_death(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(replica_id)`` (on the loop) whenever a replica is noticed dead."""
        self._death_listeners.append(listener)

    def before_traffic(self, step: BringUpStep) -> None:
        """Await ``step(replica)`` on every started replica before it takes traffic (after
        its engine is up, before the weights provider)."""
        self._bring_up_steps.append(step)

    def when_serving(self, hook: ServingHook) -> Callable[[], None]:
        """Await ``hook(ready replicas)`` each time the service serves again after a pause
        or a sleep (a push's deferred value check); returns the function that removes it."""
        self._serving_hooks.append(hook)
        return lambda: self._serving_hooks.remove(hook) if hook in self._serving_hooks else None

    async def serving_again(self) -> None:
        """Run the :meth:`when_serving` hooks, if the service now serves (the service calls
        it after resume and wake-up)."""
        if self.serving.serving:
            for hook in list(self._serving_hooks):
                await hook(self._ready)

    # ------------------------------------------------------------------ start
    async def open(self) -> None:
        """Plan what each replica reserves; call once, after Ray is connected."""
        self._res = cluster.plan_resources(self.config)
        batch_invariance.check(self._res.use_gpu, self.config)
        self._driver_ip = ray.util.get_node_ip_address()
        self._orders_starts = orders_starts(
            cluster.shares_gpus(self._res), cluster.engine_kwargs(self._res, self.config)
        )

    async def start(self, count: int, desc: str) -> list[int]:
        """Start ``count`` replicas at once (a progress bar); their ids once all serve."""
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
        if self.config.placement == "any":
            return [None] * count
        gone = (ReplicaState.DEAD, ReplicaState.STOPPED)
        ours = Counter(r.node for r in self._records.values() if r.node and r.state not in gone)
        return placement.plan(
            self.config.placement, count, self._res.need(), cluster.live_nodes(), ours, avoid
        )

    def _spec(self, rid: int) -> ReplicaSpec:
        cfg, res = self.config, self._res
        return ReplicaSpec(
            replica_id=rid,
            model=cfg.model,
            engine_kwargs=cluster.engine_kwargs(res, cfg),
            weight_version=self.labels.checkpoint,  # its engine starts with the checkpoint
            env={**cluster.process_env(res, cfg), **batch_invariance.replica_env(cfg)},
            in_process=cluster.in_process_engine(res, cfg),
            actor_extension=cfg.actor_extension_cls,
            log_file=cfg.log_file,
            engine_cls=cfg.engine_cls,
        )

    async def _start_replica(self, rid: int, node: str | None) -> None:
        cfg = self.config
        name = f"{self.name}-r{rid}-{uuid.uuid4().hex[:4]}"
        pg = await cluster.reserve(self._res, name, timeout=cfg.placement_timeout, node_ip=node)
        rec = _Record(replica_id=rid, pg=pg, node=node)
        rec.idle.set()
        self._records[rid] = rec  # registered first, so close() finds it whatever happens
        self._publish()
        rec.actor = (
            ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(VLLMReplica)
            .options(**cluster.actor_options(self._res, name, pg))
            .remote(self._spec(rid))
        )
        try:
            rec.info = await self._start_engine(rec.actor, rid)
        except ray.exceptions.RayTaskError as e:
            cause = actor_cause(e)
            if isinstance(cause, ReplicaStartupError):
                raise cause from None  # the engine's own message, not Ray's traceback
            raise
        rec.node = rec.info.node_ip
        if self._limits is None:
            self._limits = rec.info
        view = rec.view()
        for step in self._bring_up_steps:  # adapters, before it takes traffic
            await step(view)
        loaded = await self._match_service(view)
        self._admit(rec, loaded)

    async def _match_service(self, view: ReplicaView) -> str | None:
        """Bring a started replica (it holds the checkpoint, under the checkpoint's label) to
        the live weights and to the service's pause and sleep; returns the version the
        provider loaded (None: none, it still holds the checkpoint)."""
        state, actor = self.serving, view.handle
        loaded = None
        for step in restart_steps(state):
            if step == "bring_up":
                provider = self.provider
                if provider is not None and provider.version is not None:
                    loaded = await provider.bring_up(view)
            elif step == "sleep":
                await actor.sleep.remote(state.sleep_level, "abort")
            elif step == "wake_weights":
                await actor.wake_up.remote(["weights"])
            else:  # "pause"
                await actor.pause.remote(*state.paused)
        return loaded

    def _admit(self, rec: _Record, loaded: str | None) -> None:
        """A started replica that loaded ``loaded`` takes traffic if it holds the live
        weights (or the service allows mixed versions); else it is held out of it, unless no
        replica serves the live version any more: then the checkpoint is the live version."""
        labels, mixed = self.labels, self.config.allow_mixed_versions
        rec.holds = loaded
        label = labels.label_of(loaded)
        decision = labels.admit(loaded, mixed, live_served=bool(self._ready))
        if decision == "ready":
            self._set_state(rec, ReplicaState.READY)
        elif decision == "fall_back":
            self._fall_back(rec)
        elif decision == "mixed":
            logger.warning(
                "replica %d serves weight version %r beside the live version %r "
                "(allow_mixed_versions=True): its samples say so",
                rec.replica_id,
                label,
                labels.live,
            )
            self._set_state(rec, ReplicaState.READY)
        else:
            logger.warning(
                "replica %d holds weight version %r, not the live version %r, and no "
                "weight-sync scheme can bring it there: it takes no requests until a push "
                "does (launch with allow_mixed_versions=True to let it serve under its own "
                "label)",
                rec.replica_id,
                label,
                labels.live,
            )
            self._set_state(rec, ReplicaState.HELD)

    def _fall_back(self, rec: _Record) -> None:
        """No replica serves the live version any more: the checkpoint, which ``rec`` and
        the held replicas hold, becomes the live version under its own label."""
        logger.warning(
            "no replica serves weight version %r any more (each started since when no "
            "weight-sync scheme could bring it there): the service serves the checkpoint's "
            "weights under their label %r now",
            self.labels.live,
            self.labels.checkpoint,
        )
        self.labels = self.labels.fallen_back()
        for other in [rec, *self._records.values()]:
            if other is rec or (other.state is ReplicaState.HELD and other.holds is None):
                other.state = ReplicaState.READY
        self._publish()

    async def _start_engine(self, actor, rid: int) -> ReplicaInfo:
        """Start a replica's engine: at once, or in its GPU's turn when replicas share GPUs
        (:mod:`~torchrl_vllm_ext.engine.driver.start_order`: the first profiles alone, the
        others start with its KV-cache size; the startup timeout counts from the start)."""

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

    def set_provider(self, provider: WeightsProvider | None) -> None:
        """Make ``provider`` bring started replicas to the live weights (None: nobody); a
        provider with a version (a push committed it) also brings the held replicas there."""
        self.provider = provider
        if provider is not None and provider.version is not None:
            self.labels = self.labels.pushed(provider.version)
            self._publish()
            if any(r.state is ReplicaState.HELD for r in self._records.values()):
                self._spawn(self._release_held(provider))

    def relabel(self, version: str) -> None:
        """Every ready replica's weights are labelled ``version`` from now on (the caller
        labels them); no provider brings started replicas to them any more."""
        self.labels = self.labels.relabelled(version)
        self.provider = None
        self._publish()

    async def _release_held(self, provider: WeightsProvider) -> None:
        """Bring every held replica to ``provider``'s version (after the push that made it
        the provider: its bring-up waits on the push lock); each then takes traffic."""
        for rec in [r for r in self._records.values() if r.state is ReplicaState.HELD]:
            view = rec.view()
            try:
                loaded = await provider.bring_up(view)
            except Exception as e:  # dead, or the load failed: restarted, as a death
                self._died(view, e, "its bring-up to the live version")
                continue
            if rec.state is ReplicaState.HELD and self._records.get(rec.replica_id) is rec:
                self._admit(rec, loaded)

    def adopt(self, replica: ReplicaView) -> None:
        """Serve an actor started elsewhere as a ready replica.

        The pool does not own it: :meth:`close` forgets it without stopping it, and if it
        dies the pool starts a replica of its own in its place. The seam for stand-in
        actors in unit tests, and for actors a caller manages itself.
        """
        rec = _Record(replica.replica_id, pg=None, node=replica.node, owned=False)
        rec.actor, rec.info = replica.handle, replica.info
        rec.idle.set()
        self._records[replica.replica_id] = rec
        self._ids = itertools.count(max(self._records) + 1)
        if self._limits is None:
            self._limits = replica.info
        self._set_state(rec, ReplicaState.READY)

    # ------------------------------------------------------------------ stop
    async def _stop(self, rec: _Record, graceful: bool = True) -> None:
        if not rec.owned:
            rec.actor = None
        if rec.actor is not None and graceful:
            # A graceful engine shutdown also ends vLLM's child processes.
            try:
                await asyncio.wait_for(rec.actor.shutdown.remote(), self.config.shutdown_timeout)
            except (TimeoutError, *DEATH_ERRORS) as e:
                logger.info(
                    "replica %d did not shut down gracefully (%s); killing it", rec.replica_id, e
                )
        if rec.actor is not None:
            # In a thread: killing a frozen (SIGSTOPped) actor takes Ray seconds, and the
            # event loop carries every other call meanwhile.
            await asyncio.to_thread(ray.kill, rec.actor, no_restart=True)
        await asyncio.to_thread(cluster.release, rec.pg)
        rec.state = ReplicaState.STOPPED
        if self._records.get(rec.replica_id) is rec:
            del self._records[rec.replica_id]
        self._publish()

    async def remove(self, k: int, drain_timeout: float) -> list[int]:
        """Drain ``k`` ready replicas (fewest in flight first), then stop them."""
        victims = sorted(
            (self._records[v.replica_id] for v in self._ready),
            key=lambda r: (r.inflight, -r.replica_id),
        )[:k]
        for rec in victims:
            self._set_state(rec, ReplicaState.DRAINING)
        await asyncio.wait_for(asyncio.gather(*(r.idle.wait() for r in victims)), drain_timeout)
        await asyncio.gather(*(self._stop(r) for r in victims))
        return [r.replica_id for r in victims]

    async def close(self) -> None:
        """Stop the background work and every replica."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(self._stop(rec) for rec in list(self._records.values())))

    # ------------------------------------------------------------------ leases (calls: ReplicaCalls)
    @contextlib.asynccontextmanager
    async def lease(self, replica_id: int, n: int) -> AsyncIterator[None]:
        """Count ``n`` requests in flight on a replica while the block runs (load-aware
        routing reads the count; draining waits for it to reach zero)."""
        rec = self._records.get(replica_id)
        if rec is None:
            raise ReplicaDeadError(f"replica {replica_id} was stopped; it takes no requests.")
        rec.inflight += n
        rec.idle.clear()
        try:
            yield
        finally:
            rec.inflight -= n
            if rec.inflight == 0:
                rec.idle.set()

    def inflight(self, replica_id: int) -> int:
        rec = self._records.get(replica_id)
        return rec.inflight if rec is not None else 0

    async def wait_ready(self) -> tuple[ReplicaView, ...]:
        """The ready replicas; waits for one being (re)started when none is ready."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.startup_timeout
        while True:
            if self._ready:
                return self._ready
            starting = ReplicaState.STARTING in self._states.values() or self._restarting
            held = None if starting else held_refusal(self.name, self._states, self.weight_version)
            if held is not None:
                raise held
            if self._closed or not starting or loop.time() > deadline:
                raise NoHealthyReplicaError(
                    f"service {self.name} has no ready replica (states: "
                    f"{ {rid: s.value for rid, s in self._states.items()} }); add replicas "
                    "with add_replicas() or check the replicas' logs."
                )
            await asyncio.sleep(self.config.ready_poll_interval)

    # ------------------------------------------------------------------ the death policy
    def _died(self, view: ReplicaView, error: BaseException, what: str) -> ReplicaDeadError:
        """Record the death of ``view``'s replica (once), restart it, and return the
        caller's error."""
        rid = view.replica_id
        cause = f"{type(error).__name__}: {error}"
        rec = self._records.get(rid)
        alive = (ReplicaState.READY, ReplicaState.DRAINING, ReplicaState.HELD)
        # A view taken before a restart names the old actor: its death is old news.
        if rec is not None and rec.actor is view.handle and rec.state in alive:
            draining = rec.state is ReplicaState.DRAINING
            self._deaths.append(ReplicaDeath(rid, rec.node, time.time(), cause))
            self._set_state(rec, ReplicaState.DEAD)
            for listener in self._death_listeners:
                listener(rid)
            logger.warning("replica %d on node %s died during %s (%s)", rid, rec.node, what, cause)
            if not draining and not self._closed:
                self._restarting.add(rid)
                self._spawn(self._restart(rec))
        provider = self.provider
        note = self.labels.restart_note(
            provider is not None and provider.version is not None,
            self.config.allow_mixed_versions,
        )
        return ReplicaDeadError(
            f"replica {rid} died during {what} ({cause}); it is restarted {note}."
        )

    async def report_death(self, replica_id: int, process: str, cause: str, what: str) -> None:
        """A service handle in another process found replica ``replica_id`` (its actor
        process ``node:pid``, :attr:`ReplicaView.process`) dead during ``what``: the death
        policy, as for our own calls (a report about a process already replaced is old
        news)."""
        rec = self._records.get(replica_id)
        if rec is not None and rec.info is not None and rec.view().process == process:
            self._died(rec.view(), ReplicaDeadError(cause), f"{what} (seen by a handle)")

    def restart_untrusted(self, view: ReplicaView, error: BaseException, what: str) -> None:
        """Restart a live replica that must not serve (its weights failed verification, or
        a load broke off half-way): recorded and restarted as a death, at the live
        weights."""
        self._died(view, error, what)

    async def _restart(self, rec: _Record) -> None:
        # Let the caller that met the death get its error before the restart's work.
        await asyncio.sleep(0)
        try:
            await self._stop(rec, graceful=False)
            await self._start_again(rec)
        finally:
            self._restarting.discard(rec.replica_id)

    async def _start_again(self, rec: _Record) -> None:
        attempts = self.config.restart_attempts
        for attempt in range(attempts):
            try:
                # Elsewhere first: if its node is lost, Ray may not know it for seconds.
                avoid = frozenset({rec.node} if rec.node else ())
                await self._start_replica(rec.replica_id, self._plan_nodes(1, avoid)[0])
                logger.info("replica %d restarted", rec.replica_id)
                return
            except Exception as e:
                logger.error(
                    "restart of replica %d failed (try %d): %s", rec.replica_id, attempt + 1, e
                )
                failed = self._records.get(rec.replica_id)
                if failed is not None:
                    await self._stop(failed, graceful=False)
                if isinstance(e, ReplicaStartupError):
                    # vLLM itself refused (model, arguments, kernels): the same start
                    # fails the same way again, so it is not retried.
                    break
                await asyncio.sleep(self.config.restart_backoff * (attempt + 1))
        logger.error("replica %d is gone for good: it did not restart", rec.replica_id)

    # ------------------------------------------------------------------ health
    def start_health_checks(self) -> None:
        if self.config.health_check_interval > 0:
            self._spawn(self._health_loop())

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval)
            await self.check_health()

    async def check_health(self) -> dict[int, bool]:
        """Ping every ready replica; the dead are restarted. ``{replica_id: healthy}``."""
        out = await self.call_all("check_health", timeout=self.config.health_check_timeout)
        for rid, error in out.errors.items():
            logger.warning("health check of replica %d failed: %r", rid, error)
        return {
            rid: out.results.get(rid) is True
            for rid in sorted({*out.results, *out.errors, *out.dead})
        }

    # ------------------------------------------------------------------ internals
    def _set_state(self, rec: _Record, state: ReplicaState) -> None:
        rec.state = state
        self._publish()

    def _publish(self) -> None:
        """Replace the snapshots (one assignment each: readers see the old or the new)."""
        recs = sorted(self._records.values(), key=lambda r: r.replica_id)
        self._ready = tuple(r.view() for r in recs if r.state is ReplicaState.READY)
        self._states = MappingProxyType({r.replica_id: r.state for r in recs})
        for listener in self._publish_listeners:
            listener()

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


__all__ = [
    "Outcomes",
    "ReplicaFleet",
    "ReplicaPool",
    "ReplicaState",
    "ReplicaView",
    "WeightsProvider",
]
