"""ReplicaPool: the replicas of one service, their lifecycle, and one way to call them.

The pool holds the replica records and their immutable snapshots (:mod:`.records`), starts
and stops replicas (:mod:`.launcher`: placement, the actor, its engine's turn), brings each
started one to the service before it takes traffic (:mod:`.admission`: adapters, the live
weights, pause and sleep, the labels) and pings them (:mod:`.health`). Every call to
replicas goes through :meth:`ReplicaPool.call_each` (or :meth:`~ReplicaPool.call_all` /
:meth:`~ReplicaPool.call`), which applies the one death policy, the pool's own:

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
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager

from tqdm.auto import tqdm

from torchrl_vllm_ext.engine.calls import Outcomes, ReplicaCalls
from torchrl_vllm_ext.engine.config import ServiceConfig
from torchrl_vllm_ext.engine.driver.admission import Admission
from torchrl_vllm_ext.engine.driver.health import HealthChecks
from torchrl_vllm_ext.engine.driver.launcher import ReplicaLauncher
from torchrl_vllm_ext.engine.driver.records import Record, ReplicaRecords
from torchrl_vllm_ext.engine.fleet import ReplicaFleet, ReplicaState, ReplicaView, WeightsProvider
from torchrl_vllm_ext.engine.labels import held_refusal
from torchrl_vllm_ext.errors import NoHealthyReplicaError, ReplicaDeadError, ReplicaStartupError
from torchrl_vllm_ext.messages import ReplicaDeath, ReplicaInfo

logger = logging.getLogger(__name__)


class ReplicaPool(ReplicaCalls):
    """The replicas of one service: lifecycle, snapshot, fan-out, death policy.

    Its parts, each owning its state: :attr:`records` (the records, their snapshots and
    leases), :attr:`launcher` (Ray: start and stop one replica), :attr:`admission` (what a
    started replica is brought to, and whether it takes traffic) and :attr:`health`.

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
        self.records = ReplicaRecords()
        """The records, the ready / states snapshots and the leases."""
        self.launcher = ReplicaLauncher(config)
        """Starts and stops one replica (placement, the actor, its GPU's turn)."""
        self.admission = Admission(config, self.records)
        """The labels, the weights provider, the service's pause and sleep: what a started
        replica is brought to before it takes traffic, and whether it then does."""
        self.health = HealthChecks(config, self.call_all)
        self._ids = itertools.count()
        self._limits: ReplicaInfo | None = None
        self._deaths: deque[ReplicaDeath] = deque(maxlen=1000)
        self._death_listeners: list[Callable[[int], None]] = []
        self._tasks: set[asyncio.Task] = set()
        self._restarting: set[int] = set()  # ids between their death and their restart
        self._closed = False

    # ------------------------------------------------------------------ what clients read
    @property
    def weight_version(self) -> str:
        """The weights every ready replica serves (``allow_mixed_versions`` aside), and
        restarted replicas are brought to."""
        return self.admission.labels.live

    @property
    def provider(self) -> WeightsProvider | None:
        """Brings started replicas to the live weights (the scheme that pushed last)."""
        return self.admission.provider

    def ready(self) -> tuple[ReplicaView, ...]:
        """The ready replicas, by id; an immutable snapshot any thread may read."""
        return self.records.ready()

    def states(self) -> Mapping[int, ReplicaState]:
        """Every replica the pool holds and its state; an immutable snapshot."""
        return self.records.states()

    def view(self, replica_id: int) -> ReplicaView:
        """The ready replica ``replica_id``; :class:`ReplicaDeadError` if it is not ready."""
        return self.records.view(replica_id)

    def deaths(self) -> list[ReplicaDeath]:
        """Every replica death the pool noticed, oldest first (each is then restarted)."""
        return list(self._deaths)

    @property
    def limits(self) -> ReplicaInfo | None:
        """The first replica's limits (every replica serves the same model)."""
        return self._limits

    @property
    def uses_gpu(self) -> bool:
        return self.launcher.uses_gpu

    @property
    def workers_per_replica(self) -> int:
        return self.config.tensor_parallel_size * self.config.pipeline_parallel_size

    def lease(self, replica_id: int, n: int) -> AbstractAsyncContextManager[None]:
        """Count ``n`` requests in flight on a replica while the block runs."""
        return self.records.lease(replica_id, n)

    def inflight(self, replica_id: int) -> int:
        return self.records.inflight(replica_id)

    def on_death(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(replica_id)`` (on the loop) whenever a replica is noticed dead."""
        self._death_listeners.append(listener)

    def when_serving(self, hook) -> Callable[[], None]:
        """:meth:`Admission.when_serving <.admission.Admission.when_serving>` (a scheme's
        deferred value check)."""
        return self.admission.when_serving(hook)

    def set_provider(self, provider: WeightsProvider | None) -> None:
        """Make ``provider`` bring started replicas to the live weights (None: nobody); a
        provider with a version (a push committed it) also brings the held replicas there."""
        if self.admission.set_provider(provider):
            self._spawn(self.admission.release_held(provider, self._died))

    # ------------------------------------------------------------------ start and stop
    async def open(self) -> None:
        """Plan what each replica reserves; call once, after Ray is connected."""
        await self.launcher.open()

    async def start(self, count: int, desc: str) -> list[int]:
        """Start ``count`` replicas at once (a progress bar); their ids once all serve."""
        self.launcher.check_capacity(count)
        nodes = self.launcher.plan_nodes(count, self.records.nodes_in_use())
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

    async def _start_replica(self, rid: int, node: str | None) -> None:
        name = f"{self.name}-r{rid}-{uuid.uuid4().hex[:4]}"
        pg = await self.launcher.reserve(name, node)
        # Registered first, so close() finds it whatever happens.
        rec = self.records.add(Record(replica_id=rid, pg=pg, node=node))
        checkpoint = self.admission.labels.checkpoint  # its engine starts with it
        rec.actor = self.launcher.create_actor(name, pg, rid, checkpoint)
        rec.info = await self.launcher.start_engine(rec.actor, rid)
        rec.node = rec.info.node_ip
        if self._limits is None:
            self._limits = rec.info
        loaded = await self.admission.bring_to_service(rec.view())
        self.admission.admit(rec, loaded)

    async def _stop(self, rec: Record, graceful: bool = True) -> None:
        await self.launcher.stop(rec.replica_id, rec.actor, rec.pg, graceful)
        rec.state = ReplicaState.STOPPED
        self.records.forget(rec)

    async def remove(self, k: int, drain_timeout: float) -> list[int]:
        """Drain ``k`` ready replicas (fewest in flight first), then stop them."""
        victims = sorted(
            (self.records.get(v.replica_id) for v in self.ready()),
            key=lambda r: (r.inflight, -r.replica_id),
        )[:k]
        for rec in victims:
            self.records.set_state(rec, ReplicaState.DRAINING)
        await asyncio.wait_for(asyncio.gather(*(r.idle.wait() for r in victims)), drain_timeout)
        await asyncio.gather(*(self._stop(r) for r in victims))
        return [r.replica_id for r in victims]

    async def close(self) -> None:
        """Stop the background work and every replica."""
        self._closed = True
        await self.health.stop()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(self._stop(rec) for rec in self.records.all()))

    async def wait_ready(self) -> tuple[ReplicaView, ...]:
        """The ready replicas; waits for one being (re)started when none is ready."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.startup_timeout
        while True:
            ready, states = self.ready(), self.states()
            if ready:
                return ready
            starting = ReplicaState.STARTING in states.values() or self._restarting
            held = None if starting else held_refusal(self.name, states, self.weight_version)
            if held is not None:
                raise held
            if self._closed or not starting or loop.time() > deadline:
                raise NoHealthyReplicaError(
                    f"service {self.name} has no ready replica (states: "
                    f"{ {rid: s.value for rid, s in states.items()} }); add replicas "
                    "with add_replicas() or check the replicas' logs."
                )
            await asyncio.sleep(self.config.ready_poll_interval)

    # ------------------------------------------------------------------ the death policy
    def _died(self, view: ReplicaView, error: BaseException, what: str) -> ReplicaDeadError:
        """Record the death of ``view``'s replica (once), restart it, and return the
        caller's error."""
        rid = view.replica_id
        cause = f"{type(error).__name__}: {error}"
        rec = self.records.get(rid)
        alive = (ReplicaState.READY, ReplicaState.DRAINING, ReplicaState.HELD)
        # A view taken before a restart names the old actor: its death is old news.
        if rec is not None and rec.actor is view.handle and rec.state in alive:
            draining = rec.state is ReplicaState.DRAINING
            self._deaths.append(ReplicaDeath(rid, rec.node, time.time(), cause))
            self.records.set_state(rec, ReplicaState.DEAD)
            for listener in self._death_listeners:
                listener(rid)
            logger.warning("replica %d on node %s died during %s (%s)", rid, rec.node, what, cause)
            if not draining and not self._closed:
                self._restarting.add(rid)
                self._spawn(self._restart(rec))
        return ReplicaDeadError(
            f"replica {rid} died during {what} ({cause}); it is restarted "
            f"{self.admission.restart_note()}."
        )

    async def report_death(self, replica_id: int, process: str, cause: str, what: str) -> None:
        """A service handle in another process found replica ``replica_id`` (its actor
        process ``node:pid``, :attr:`ReplicaView.process`) dead during ``what``: the death
        policy, as for our own calls (a report about a process already replaced is old
        news)."""
        rec = self.records.get(replica_id)
        if rec is not None and rec.info is not None and rec.view().process == process:
            self._died(rec.view(), ReplicaDeadError(cause), f"{what} (seen by a handle)")

    def restart_untrusted(self, view: ReplicaView, error: BaseException, what: str) -> None:
        """Restart a live replica that must not serve (its weights failed verification, or
        a load broke off half-way): recorded and restarted as a death, at the live
        weights."""
        self._died(view, error, what)

    async def _restart(self, rec: Record) -> None:
        # Let the caller that met the death get its error before the restart's work.
        await asyncio.sleep(0)
        try:
            await self._stop(rec, graceful=False)
            await self._start_again(rec)
        finally:
            self._restarting.discard(rec.replica_id)

    async def _start_again(self, rec: Record) -> None:
        attempts = self.config.restart_attempts
        for attempt in range(attempts):
            try:
                # Elsewhere first: if its node is lost, Ray may not know it for seconds.
                avoid = frozenset({rec.node} if rec.node else ())
                node = self.launcher.plan_nodes(1, self.records.nodes_in_use(), avoid)[0]
                await self._start_replica(rec.replica_id, node)
                logger.info("replica %d restarted", rec.replica_id)
                return
            except Exception as e:
                logger.error(
                    "restart of replica %d failed (try %d): %s", rec.replica_id, attempt + 1, e
                )
                failed = self.records.get(rec.replica_id)
                if failed is not None:
                    await self._stop(failed, graceful=False)
                if isinstance(e, ReplicaStartupError):
                    # vLLM itself refused (model, arguments, kernels): the same start
                    # fails the same way again, so it is not retried.
                    break
                await asyncio.sleep(self.config.restart_backoff * (attempt + 1))
        logger.error("replica %d is gone for good: it did not restart", rec.replica_id)

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
