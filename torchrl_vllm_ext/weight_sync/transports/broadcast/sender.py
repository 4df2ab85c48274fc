"""The broadcast transport: packed buckets over a process group of the trainer and every
replica worker (NCCL on GPU, gloo on CPU; see :mod:`.collective`). Its receiver:
:mod:`.receiver`.

``prepare``: 1) pack same-dtype tensors into buckets (with delta pushes: cast to the
served dtype, and where every replica's workers hold the committed version in their
receive buffers, only what changed since it: :mod:`...delta`); 2) form the group if its
members changed; 3) one header per replica (``stage_weight_broadcast``): its workers receive and
verify the buckets in a background thread while still generating; 4) one collective per
bucket while 5) every replica is polled until each of its workers has verified. In the
pause the workers only load (``apply_staged_weights``). A collective cannot lose a
member: a replica that dies during a push, or leaves a poll unanswered for
``deadline.answer_s`` (frozen), is killed and restarted by the pool, and the push fails
naming it; the group is formed again on the next push. Every wait has a deadline
(:class:`~torchrl_vllm_ext.deadlines.Deadline`): the group's collectives and the send
``fixed_s + bytes / min_bytes_per_s``, the staging and each poll ``answer_s``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import ray
import torch

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.extensions import WorkerMethods
from torchrl_vllm_ext.listening import listen
from torchrl_vllm_ext.weight_sync.delta import (
    WORTH_SHARE,
    checksum_after,
    diff_and_sum,
    split_payload,
)
from torchrl_vllm_ext.weight_sync.params import (
    device_checksums,
    require_all_finite,
    torch_dtype,
)
from torchrl_vllm_ext.weight_sync.specs import (
    PerWorkerUpdate,
    UpdateHeader,
    WorkerPayload,
    to_json,
)
from torchrl_vllm_ext.weight_sync.transports.broadcast.collective import BroadcastGroup
from torchrl_vllm_ext.weight_sync.transports.broadcast.per_worker import (
    BROADCAST,
    PER_WORKER,
    Cuts,
    Runs,
    broadcast_reason,
    choose_route,
    cut_runs,
    gather,
    runs_digest,
)
from torchrl_vllm_ext.weight_sync.transports.packing import Packed, with_checksums
from torchrl_vllm_ext.weight_sync.transports.protocol import (
    Outcomes,
    Prepared,
    Replicas,
    Streamed,
    Transport,
    TransportOptions,
    WorkerCall,
    calls_for,
    raise_errors,
)
from torchrl_vllm_ext.weight_sync.transports.versions import PackedVersions
from torchrl_vllm_ext.weight_sync.transports.waits import wait_for_answers, wait_staged


def _cut(
    header: UpdateHeader,
    buffers: list[torch.Tensor],
    reported: dict[int, list[Runs]],
    replicas: Replicas,
    workers: int,
    cuts: Cuts,
    kept: dict[str, torch.Tensor],
) -> tuple[dict[int, str], list[tuple[int, torch.Tensor]]]:
    """Each replica's :class:`PerWorkerUpdate` (JSON) and every ``(group rank, payload)``
    to send: each worker's slices cut from the buckets (workers that keep the same
    slices share one payload; ``cuts``: their byte runs, kept from push to push; ``kept``:
    the last push's payloads by digest, written over, left holding this push's)."""
    payloads: dict[str, tuple[WorkerPayload, torch.Tensor]] = {}
    updates, sends = {}, []
    for i, r in enumerate(replicas):
        specs = []
        for w, runs in enumerate(reported[r.replica_id]):
            digest = runs_digest(runs)
            if digest not in payloads:
                payload = gather(buffers, cut_runs(header, runs, digest, cuts), kept.get(digest))
                spec = WorkerPayload(payload.numel(), device_checksums([payload])[0], digest)
                payloads[digest] = (spec, payload)
            spec, payload = payloads[digest]
            specs.append(spec)
            sends.append((1 + i * workers + w, payload))
        updates[r.replica_id] = to_json(PerWorkerUpdate(header, tuple(specs)))
    kept.clear()
    kept.update((digest, payload) for digest, (_, payload) in payloads.items())
    return updates, sends


def _with_checksums(buckets: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The buckets, then their checksums as one int64 tensor (uint64 sums wrapped)."""
    sums = []
    for bucket in buckets:
        sums.append(device_checksums([bucket])[0])
        yield bucket
        del bucket  # sent: freed before the next one is asked for
    yield torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in sums], dtype=torch.int64)


@dataclass(frozen=True)
class GroupMembers:
    """Whom the broadcast group was formed with: a push to other replica processes, or
    with another timeout, forms a new group."""

    processes: tuple[str, ...]
    """The member replicas' processes (:attr:`ReplicaView.process`), in rank order."""
    timeout_s: float
    """The group's collectives' timeout."""

    @classmethod
    def of(cls, replicas: Replicas, timeout_s: float) -> GroupMembers:
        return cls(tuple(r.process for r in replicas), timeout_s)


class BroadcastTransport(Transport, Streamed):
    """Weights as packed buckets broadcast from the trainer (rank 0) to every worker; or
    buckets sent as they come (:class:`~..protocol.Streamed`).

    Args:
        fleet: the replicas pushed to (a service's ``pool``).
        options: ``bucket_bytes``, ``deadline`` (see the module docstring) and ``backend``
            (``nccl`` / ``gloo``; default: NCCL when the replicas and this process have GPUs).

    Examples:
        >>> scheme = WeightSyncScheme(service, transport="broadcast")  # doctest: +SKIP
        >>> scheme.transport_impl.backend  # doctest: +SKIP
        'gloo'
    """

    name = "broadcast"
    loads_one_at_a_time = False

    def __init__(self, fleet, options: TransportOptions):
        super().__init__(fleet, options)
        backend = options.backend
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() and fleet.uses_gpu else "gloo"
        self.backend = backend
        self.group: BroadcastGroup | None = None
        self._members: GroupMembers | None = None
        # The trainer's buckets, re-packed in place push to push; the committed ones for
        # restarts, and the base of a delta.
        self._versions = PackedVersions()
        self._dtype = torch_dtype(options.delta_dtype) if options.delta_dtype else None
        # Cast as packed: the packed buckets are checked for NaN / inf (half an fp32 push's
        # bytes; a value past the served dtype's range is caught as the inf it becomes).
        self.checks_finite = self._dtype is not None
        self._payloads: dict[str, torch.Tensor] = {}
        """Per-worker sends: the last push's payloads by digest (the next is cut into them)."""
        self._cuts: Cuts = {}
        """Per-worker sends: each worker's byte runs of the buckets, by its runs' digest
        and the buckets' layout."""
        self._held: dict[str, str] = {}
        """Replica process (:attr:`ReplicaView.process`) -> the version its workers' receive buffers hold (what a delta
        changes); forgotten when the group is formed again (the workers drop them)."""

    @property
    def group_port(self) -> int | None:
        return self.group.port if self.group is not None else None

    async def prepare(
        self,
        tensors: dict[str, torch.Tensor],
        version: str,
        replicas: Replicas,
        packed: Packed | None = None,
    ) -> Prepared:
        phases: dict[str, float] = {}
        delta = None
        if packed is None:  # 1) into the set of buckets the committed version is not in
            t0 = time.perf_counter()
            packed = await asyncio.to_thread(
                self._versions.pack,
                tensors,
                version,
                self.options.bucket_bytes,
                self._dtype,
                self._dtype is None,  # a delta's checksums follow from its base's
            )
            phases["pack"] = time.perf_counter() - t0
            base = self._delta_base(packed, replicas)
            if base is not None:
                t1 = time.perf_counter()
                delta = await asyncio.to_thread(self._delta, packed, base, self.checks_finite)
                phases["diff"] = time.perf_counter() - t1
            if delta is None:
                t1 = time.perf_counter()
                if self._dtype is not None:
                    packed = await asyncio.to_thread(with_checksums, packed)
                if self.checks_finite:
                    await asyncio.to_thread(require_all_finite, packed.tensors())
                phases["pack"] += time.perf_counter() - t1
            else:
                full = dataclasses.replace(delta[0], base="", deltas=())  # restarts: this
                packed = Packed(full, packed.buffers)
        nbytes = sum(b.numel() * b.element_size() for b in packed.buffers)
        header, buffers = (packed.header, packed.buffers) if delta is None else delta
        try:
            sends, why, reported = await self._choose_sends(header, replicas)
            if sends == PER_WORKER:
                prepared = await self._send_per_worker(header, buffers, reported, nbytes, replicas)
            else:
                prepared = await self._broadcast(header, buffers, nbytes, version, replicas)
        except BaseException:
            self._held.clear()  # what the workers hold is unknown: the next push is full
            raise
        self._versions.stage(packed)
        sent = prepared.sent_bytes
        return Prepared(
            prepared.calls,
            prepared.staged_in,
            {**phases, **prepared.phases},
            sent_bytes=sum(b.numel() for b in buffers) if sent is None else sent,
            base=header.base or None,
            sends=(sends, why),
        )

    async def _choose_sends(
        self, header: UpdateHeader, replicas: Replicas
    ) -> tuple[str, str, dict[int, list[Runs | None]]]:
        """Whether ``header``'s push is sent per worker (:mod:`.per_worker`): ``(route,
        why, each replica's workers' slices)``; the workers are asked for their slices
        only where per-worker sends may be done."""
        why = broadcast_reason(
            self.backend,
            self.fleet.workers_per_replica,
            self._dtype is not None,
            self.options.per_worker_sends,
        )
        if header.base:
            why = "a delta push changes the whole buffers every worker holds"
        if why is not None or not replicas:
            return BROADCAST, why or "no replica to push to", {}
        outcomes = await self.fleet.call_all(
            "collective_rpc",
            WorkerMethods.BROADCAST_SLICES,
            (to_json(header),),
            replicas=replicas,
            deadline=self.deadline.answer_s,
        )
        self._check(outcomes, "the slices report", header.version)
        reported = dict(outcomes.results)
        return (*choose_route(reported), reported)

    async def _send_per_worker(
        self,
        header: UpdateHeader,
        buffers: list[torch.Tensor],
        reported: dict[int, list[Runs]],
        nbytes: int,
        replicas: Replicas,
    ) -> Prepared:
        """2) to 5) of ``prepare``, each worker sent only its slices (``reported``) point
        to point: its payload cut from the buckets and checksummed, its header
        (``stage_weight_sends``), then one send per worker. The workers' buffers then
        hold slices only: no delta is based on them."""
        version = header.version
        limit = self.deadline.for_bytes(nbytes)
        t0 = time.perf_counter()
        await self._ensure_group(replicas, limit)  # 2) ranks follow ``replicas``' order
        t1 = time.perf_counter()
        updates, sends = await asyncio.to_thread(
            _cut,
            header,
            buffers,
            reported,
            replicas,
            self.fleet.workers_per_replica,
            self._cuts,
            self._payloads,
        )
        cut = time.perf_counter() - t1

        def stage(r):
            args = (updates[r.replica_id],)
            return r.handle.collective_rpc.remote(WorkerMethods.STAGE_SENDS, args)

        staged = await self.fleet.call_each(  # 3)
            stage, replicas, "collective_rpc", deadline=self.deadline.answer_s
        )
        self._check(staged, "stage", version)
        for r in replicas:
            self._held.pop(r.process, None)
        group = self.group
        try:
            await self._send(lambda: group.send_each(sends), replicas, version, limit)
        except BaseException:
            self._drop_group()
            raise
        call = WorkerCall(WorkerMethods.APPLY_STAGED, (version,))
        return Prepared(
            calls_for(replicas, call),
            phases={"cut": cut, "send": time.perf_counter() - t0 - cut},
            sent_bytes=sum(p.numel() for _, p in sends),
        )

    def _delta_base(self, packed: Packed, replicas: Replicas) -> Packed | None:
        """The committed buckets a delta of ``packed`` may change: delta pushes on, the
        same layout, and every replica's workers holding that version."""
        base = self._versions.committed
        if self._dtype is None or base is None or base.buffers is packed.buffers or not replicas:
            return None
        if [b.tensors for b in base.header.buckets] != [b.tensors for b in packed.header.buckets]:
            return None
        members = self._members
        if (
            self.group is None
            or members is None
            or members.processes != tuple(r.process for r in replicas)
        ):
            return None  # the group is formed again: its workers drop their buffers
        if any(self._held.get(r.process) != base.version for r in replicas):
            return None
        return base

    @staticmethod
    def _delta(
        packed: Packed, base: Packed, checks_finite: bool
    ) -> tuple[UpdateHeader, list[torch.Tensor]] | None:
        """``packed`` (its checksums not yet summed) as a delta of ``base``'s buckets: its
        header (the new buckets' checksums: the base's plus what changed) and the payloads
        of the buckets that changed; None when the full buckets are hardly larger. Only
        the changed values are checked for NaN / inf: the others are the base's, checked
        when it was pushed."""
        deltas, payloads, specs, sent = [], [], [], 0
        old_buckets = zip(base.header.buckets, base.buffers, strict=True)
        new_buckets = zip(packed.header.buckets, packed.buffers, strict=True)
        for (spec, new), (was, old) in zip(new_buckets, old_buckets, strict=True):
            delta, payload, sum_change = diff_and_sum(new, old, spec)
            deltas.append(delta)
            values, _ = split_payload(spec, delta, payload)
            if checks_finite and not bool(values.view(torch_dtype(spec.dtype)).isfinite().all()):
                require_all_finite(packed.tensors())  # raises, naming the tensor
            checksum = (
                checksum_after(was.checksum, 0, sum_change)
                if sum_change is not None
                else device_checksums([new])[0]
            )
            specs.append(dataclasses.replace(spec, checksum=checksum))
            if payload.numel():
                payloads.append(payload)
                sent += payload.numel()
            if sent > WORTH_SHARE * packed.nbytes:
                return None
        header = UpdateHeader(packed.version, tuple(specs), base=base.version, deltas=tuple(deltas))
        return header, payloads

    @property
    def bucket_bytes(self) -> int:
        return self.options.bucket_bytes

    async def prepare_streamed(
        self, header: UpdateHeader, buckets: Iterable[torch.Tensor], replicas: Replicas
    ) -> Prepared:
        """``prepare`` of buckets that come one at a time (a sharded trainer's ranks gather
        them in lockstep, :mod:`...sharded.streamed`): each is sent as it comes, and their
        checksums, not known when the header went out, follow the last one
        (``header.checksums_follow``). No copy stays here: a restarted replica waits for
        the next push."""
        nbytes = sum(b.nbytes for b in header.buckets)
        self._versions.stage(None)
        return await self._broadcast(
            header, _with_checksums(buckets), nbytes, header.version, replicas
        )

    async def _broadcast(
        self, header: UpdateHeader, buffers, nbytes: int, version: str, replicas: Replicas
    ) -> Prepared:
        """2) to 5) of ``prepare``."""
        header_json = to_json(header)
        limit = self.deadline.for_bytes(nbytes)
        t1 = time.perf_counter()
        await self._ensure_group(replicas, limit)  # 2)
        staged = await self.fleet.call_all(  # 3)
            "collective_rpc",
            WorkerMethods.STAGE_BROADCAST,
            (header_json,),
            replicas=replicas,
            deadline=self.deadline.answer_s,
        )
        self._check(staged, "stage", version)
        group = self.group
        try:
            await self._send(lambda: group.send(buffers), replicas, version, limit)  # 4), 5)
        except BaseException:
            self._drop_group()
            raise
        for r in replicas:  # their workers' buffers hold this version now
            self._held[r.process] = version
        call = WorkerCall(WorkerMethods.APPLY_STAGED, (version,))
        return Prepared(calls_for(replicas, call), phases={"send": time.perf_counter() - t1})

    async def _send(
        self, send: Callable[[], None], replicas: Replicas, version: str, limit: float
    ) -> None:
        """4) Send (``send``: the buckets' broadcast or the per-worker sends, in a thread)
        while 5) polling every replica until each worker verified them, all within
        ``limit`` seconds."""
        sending = asyncio.ensure_future(asyncio.to_thread(send))
        # If a failed replica ends this push first, the send ends later (the killed
        # member's sockets close, or the group's timeout): its error is not news then.
        sending.add_done_callback(lambda f: f.cancelled() or f.exception())
        # On a deadline or a dead replica the caller drops the group: a collective may
        # still be in flight on it.
        await wait_staged(
            self.fleet,
            replicas,
            version,
            limit,
            self.deadline.answer_s,
            check=lambda outcomes, v: self._check(outcomes, "receive", v),
            sending=sending,
        )
        if not sending.done():  # no replica to poll: the send alone (the group's timeout)
            await asyncio.wait({sending})
        if sending.exception() is not None:
            await self._send_failed(sending.exception(), replicas, version)

    async def _send_failed(self, error: BaseException, replicas: Replicas, version: str):
        """The trainer's send failed: a member died or stopped. Name it if a last poll
        finds it (the death policy restarts it); raise in any case."""
        await self._poll(replicas, version, self.deadline.answer_s)
        raise WeightSyncError(
            f"broadcast of version {version} failed: {error}; replicas keep their weights."
        ) from error

    async def _poll(self, replicas: Replicas, version: str, deadline: float) -> Outcomes:
        """Ask every receiver whether its workers verified ``version``; a replica that
        died or gave no answer within ``deadline`` fails the push, naming it."""
        ready = await self.fleet.call_all(
            "collective_rpc",
            WorkerMethods.STAGED_READY,
            (version,),
            replicas=replicas,
            deadline=deadline,
        )
        self._check(ready, "receive", version)
        return ready

    def _check(self, outcomes: Outcomes, what: str, version: str) -> None:
        if outcomes.dead:
            self._drop_group()
            causes = "; ".join(str(e) for e in outcomes.dead.values())
            raise WeightSyncError(
                f"replica(s) {sorted(outcomes.dead)} died or stopped answering during {what} of "
                f"version {version}; the broadcast group is broken, so no replica loaded it and "
                f"every replica keeps its previous weights. The service restarts the dead "
                f"replica(s) at the live version; push again. ({causes})"
            )
        raise_errors(outcomes, what, version)

    async def connect(self, replicas: Replicas, nbytes: int) -> None:
        await self._ensure_group(replicas, self.deadline.for_bytes(nbytes))

    async def commit(self, version: str) -> None:
        self._versions.commit()

    async def rollback(self, version: str) -> None:
        self._versions.rollback()

    async def bring_up(self, replica, version: str, packed: Packed | None = None) -> None:
        packed = packed or self._versions.committed
        if packed is None or packed.version != version:
            raise WeightSyncError(
                f"no committed broadcast of version {version} to bring replica "
                f"{replica.replica_id} up; push again."
            )
        header_json, buffers = to_json(packed.header), packed.buffers
        handle = replica.handle
        limit = self.deadline.for_bytes(sum(b.numel() * b.element_size() for b in buffers))
        # Not in the pool's snapshot yet (it takes no traffic): its handle, directly.
        group = await self._form_group([replica], limit, through_pool=False)
        try:
            ref = handle.collective_rpc.remote(WorkerMethods.RECEIVE_BROADCAST, (header_json,))
            await asyncio.to_thread(group.send, buffers)
            await ref
            await handle.collective_rpc.remote(WorkerMethods.CLOSE_BROADCAST)
        finally:
            group.close()

    # ------------------------------------------------------------------ the group
    async def _form_group(
        self, replicas: Replicas, timeout_s: float, through_pool: bool = True
    ) -> BroadcastGroup:
        """Rank 0 here, every worker of ``replicas`` after it; collectives time out after
        ``timeout_s``. The joins go through the pool's death policy (``through_pool``), as
        every call of a push does; a replica being brought up is called directly."""
        host = ray.util.get_node_ip_address()
        listener = listen(host)  # bound before the workers are told its port: no race
        port = listener.getsockname()[1]
        n = self.fleet.workers_per_replica
        world = 1 + n * len(replicas)
        offsets = {r.replica_id: 1 + i * n for i, r in enumerate(replicas)}

        def join(r):
            args = (host, port, world, offsets[r.replica_id], self.backend, timeout_s)
            return r.handle.collective_rpc.remote(WorkerMethods.INIT_BROADCAST, args)

        if through_pool:
            joins = self.fleet.call_each(join, replicas, "collective_rpc", deadline=timeout_s)
        else:
            joins = asyncio.gather(*(join(r) for r in replicas))
        joining = asyncio.ensure_future(joins)
        # Rank 0's store blocks until every worker joined.
        try:
            group = await asyncio.to_thread(
                BroadcastGroup, self.backend, host, port, world, timeout_s, listener
            )
        except BaseException:
            await asyncio.gather(joining, return_exceptions=True)
            raise
        try:
            joined = await asyncio.wait_for(joining, timeout_s)
            failed = {**joined.dead, **joined.errors} if isinstance(joined, Outcomes) else {}
            if failed:
                raise WeightSyncError(
                    f"replica(s) {sorted(failed)} could not join the broadcast group "
                    f"({'; '.join(map(str, failed.values()))}); nothing was sent. The dead are "
                    "restarted at the live version; push again."
                )
        except BaseException:
            group.close()
            raise
        return group

    async def _ensure_group(self, replicas: Replicas, timeout_s: float) -> None:
        members = GroupMembers.of(replicas, timeout_s)
        if self.group is not None and members == self._members:
            return
        self._drop_group()
        self._held.clear()  # workers joining a group drop their buffers
        self.group = await self._form_group(replicas, timeout_s)
        self._members = members

    def _drop_group(self) -> None:
        if self.group is not None:
            members = self._members.processes if self._members is not None else ()
            closing = [
                r.handle.collective_rpc.remote(WorkerMethods.CLOSE_BROADCAST)
                for r in self.fleet.ready()
                if r.process in members
            ]
            # NOTE: freeing a group whose member stopped answering blocks (the rendezvous
            # store's shutdown waits on it): off the event loop, which serves everyone.
            threading.Thread(
                target=self._close_group,
                args=(self.group, closing, self.deadline.answer_s),
                name="tvllm-group-close",
                daemon=True,
            ).start()
        self.group, self._members = None, None

    @staticmethod
    def _close_group(group: BroadcastGroup, closing: list, timeout_s: float) -> None:
        group.close()
        wait_for_answers(closing, timeout_s, "close its broadcast group")

    def close(self) -> None:
        self._drop_group()
        self._versions.clear()
        self._payloads.clear()
