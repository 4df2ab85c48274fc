"""ShardedWeightSync: a push called by every rank of a sharded trainer (FSDP2 / DTensor).

Every rank calls :meth:`ShardedWeightSync.push` at the same point of its loop with its own
sharded model; rank 0 of the group holds the :class:`~..scheme.WeightSyncScheme` and talks
to the service; every rank returns the same :class:`~..report.SyncReport` or raises the
same :class:`~torchrl_vllm_ext.errors.ShardedPushError`. No rank gathers the model:

1. ``layout``: each rank posts its parameters' names, shapes and dtypes, the version it was
   given, and the first non-finite parameter of its shards; every rank checks them alike
   (ranks that disagree are named before anything is written);
2. ``plan`` (rank 0): a :class:`~.plan.ShardedPlan`: the names checked against the
   served checkpoint, the version (the one given, else TorchRL's next), whether the value
   check runs, and the transport's part: a slot reserved for the ranks to write
   (:class:`~..transports.protocol.WrittenByRanks`: storage) or the buckets to gather
   (:class:`~..transports.protocol.Streamed`: broadcast);
3. storage: every rank writes its blocks straight into the slot (``wrote``), then
   checksums the whole tensors it is given, balanced by bytes (``sums``); broadcast: the
   ranks gather bucket by bucket in lockstep and rank 0 sends each bucket as it completes
   (:mod:`.streamed`);
4. the value check's reference, when due: a collective forward on every rank;
5. rank 0 hands the scheme a :class:`~..delivery.Delivery` of what the ranks did (the
   slot to publish, or the buckets to stream; the reference; their steps' seconds) and it
   runs the pause, load, check and commit (``WeightSyncScheme.apush_prepared``); rank 0
   then posts the ``result`` every rank returns.

Each step waits at most its deadline for every rank (:mod:`.rendezvous`): a rank that died
or never called the push is named, and nothing is published, so the replicas keep the last
version, as with a writer killed mid-write.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from torchrl_vllm_ext.deadlines import Deadline
from torchrl_vllm_ext.errors import ConfigurationError, ShardedPushError, WeightSyncError
from torchrl_vllm_ext.weight_sync.delivery import Delivery
from torchrl_vllm_ext.weight_sync.params import require_finite
from torchrl_vllm_ext.weight_sync.report import SyncReport
from torchrl_vllm_ext.weight_sync.sharded.layout import assign, part_of
from torchrl_vllm_ext.weight_sync.sharded.plan import ShardedPlan, make_plan
from torchrl_vllm_ext.weight_sync.sharded.rendezvous import Rendezvous
from torchrl_vllm_ext.weight_sync.sharded.routes import sharded_route
from torchrl_vllm_ext.weight_sync.sharded.storage import SlotBlocks
from torchrl_vllm_ext.weight_sync.sharded.streamed import Handoff, gathered, nbytes_of
from torchrl_vllm_ext.weight_sync.sources import unwrap
from torchrl_vllm_ext.weight_sync.specs import from_json, to_json
from torchrl_vllm_ext.weight_sync.torchrl.pushes import TorchRLPushes
from torchrl_vllm_ext.weight_sync.transports.protocol import Streamed, WrittenByRanks
from torchrl_vllm_ext.weight_sync.verify import TimedReference, collective_reference

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RanksDone:
    """What every rank did before rank 0 has the scheme deliver (steps 1 to 4)."""

    phases: dict[str, float]
    """Seconds of each step (``agree``, ``reference``, ``ranks_write``)."""
    start: float
    """When rank 0's push began (``time.perf_counter``)."""
    reference: TimedReference | None
    """The value check's reference, from the collective forward (None: unchecked)."""
    sums: dict[str, int] | None
    """Written: every tensor's checksum in the slot (None: streamed)."""

    def delivery(self, plan: ShardedPlan, prepare) -> Delivery:
        """The scheme's :class:`~..delivery.Delivery` of ``plan`` by ``prepare``."""
        return Delivery(plan.version, plan.nbytes, prepare, self.reference, self.phases, self.start)


class ShardedWeightSync:
    """A push from a trainer sharded over the ranks of ``group``; built on every rank.

    Args:
        scheme: on rank 0 of ``group``, the :class:`~..scheme.WeightSyncScheme` of the
            service (``transport="storage"``, ``"broadcast"`` or ``"auto"``, which
            picks one of them); None on every other rank.
        group: the trainer's process group (default: the whole world). Rank 0 of it
            talks to the service.
        deadline: how long each step waits for every rank (default: the scheme's,
            ``fixed_s + bytes / min_bytes_per_s``).
        host: where rank 0's coordination store listens (default: ``MASTER_ADDR``, else
            the loopback).

    Examples:
        >>> from torch.distributed.fsdp import fully_shard
        >>> for layer in model.model.layers:  # doctest: +SKIP
        ...     fully_shard(layer)
        >>> fully_shard(model)  # doctest: +SKIP
        >>> # on every rank: rank 0 holds the scheme, the others None
        >>> scheme = WeightSyncScheme(service, "storage") if rank == 0 else None  # doctest: +SKIP
        >>> sync = ShardedWeightSync(scheme)  # doctest: +SKIP
        >>> sync.push(model).version  # every rank, after each optimizer step  # doctest: +SKIP
        '1'
    """

    def __init__(self, scheme=None, group=None, *, deadline: Deadline | None = None, host=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.rendezvous = Rendezvous(group, host)
        try:
            self.rendezvous.post("holds_scheme", scheme is not None)
            holders = self.rendezvous.gather("holds_scheme", 600.0)
        except BaseException:
            self.rendezvous.close()
            raise
        if holders != [True] + [False] * (self.world - 1):
            self.rendezvous.close()
            raise ConfigurationError(
                f"ShardedWeightSync: the ranks holding a scheme are "
                f"{[r for r, h in enumerate(holders) if h]}; rank 0 of the group must hold the "
                "WeightSyncScheme and every other rank pass None."
            )
        self.scheme = scheme
        self.blocks = SlotBlocks()
        self.version: str | None = None
        """The version the last push made live (the same on every rank)."""
        self.last_report: SyncReport | None = None
        self.transport: WrittenByRanks | Streamed | None = None
        """Rank 0: the scheme's transport, as the capability the push goes through."""
        if scheme is not None:
            deadline = deadline or scheme.deadline
            try:
                self.transport = sharded_route(scheme.transport_impl)
            except ConfigurationError as e:  # every rank raises it, naming the transport
                self.rendezvous.fail("setup", e)
                self.rendezvous.close()
                raise
            setup = {"fixed_s": deadline.fixed_s, "rate": deadline.min_bytes_per_s}
            self.rendezvous.post("setup", setup)
        try:
            setup = self.rendezvous.one("setup", 0, 600.0)
        except BaseException:
            self.rendezvous.close()
            raise
        self.deadline = deadline or Deadline(setup["fixed_s"], setup["rate"])
        self.torchrl = TorchRLPushes(self.push, self._current)
        """TorchRL's collector (on rank 0) pushes through this: ``WeightSyncUpdater(sync)``."""

    def _current(self) -> str:
        return self.scheme.fleet.weight_version if self.scheme is not None else self.version

    # ------------------------------------------------------------------ the push
    def push(self, weights, version: str | int | None = None) -> SyncReport:
        """Push this rank's shards of ``weights`` (the sharded model; every rank at once).

        ``version``: the label to serve it as; None on every rank but one is allowed (the
        given one is used), none given: TorchRL's next version (rank 0's counter).
        """
        rv = self.rendezvous
        rv.next_push()
        start = time.perf_counter()
        parts, module, given, state = self._layout(weights, version)
        plan = self._plan(parts, module, given)
        pushed = set(plan.names)
        parts = [pl for pl in parts if pl[0].name in pushed]
        deadline = self.deadline.for_bytes(plan.nbytes)
        phases = {"agree": time.perf_counter() - start}
        reference = None
        if plan.reference_dtype is not None:
            t0 = time.perf_counter()
            expected = self._step(
                "reference",
                deadline,
                lambda: collective_reference(module, list(plan.probe), plan.reference_dtype),
            )
            reference = TimedReference(expected, time.perf_counter() - t0)
            phases["reference"] = reference.seconds
        sums = None
        if plan.written:
            t0 = time.perf_counter()
            sums = self._write(parts, plan, deadline)
            phases["ranks_write"] = time.perf_counter() - t0
        done = RanksDone(phases, start, reference, sums)
        report = self._deliver(plan, done, deadline, state)
        self.version, self.last_report = report.version, report
        logger.info(
            "sharded push of version %s from %d ranks: %.3fs",
            report.version,
            self.world,
            time.perf_counter() - start,
        )
        return report

    def _step(self, step: str, deadline: float, work):
        """Run ``work`` here, then wait until every rank did its own (the same error on
        every rank if one failed); the result of this rank's work."""
        rv = self.rendezvous
        try:
            out = work()
        except Exception as e:
            rv.fail(step, e)
        else:
            rv.post(step, None)
        rv.gather(step, deadline)
        return out

    def _layout(self, weights, version) -> tuple[list, nn.Module | None, str | None, dict]:
        """1) this rank's parts, checked against every other rank's; the module, the
        version given and the sharded tensors."""
        rv = self.rendezvous
        try:
            module, state = _sharded_state(weights)
            parts = [part_of(name, t, self.rank) for name, t in state.items()]
            bad = None
            for part, local in parts:
                try:
                    require_finite(part.name, local)
                except WeightSyncError as e:
                    bad = str(e)
                    break
            specs = [(p.name, list(p.shape), p.dtype) for p, _ in parts]
        except Exception as e:
            rv.fail("layout", e)
            rv.gather("layout", self.deadline.fixed_s)
            raise AssertionError("unreachable")  # noqa: B904 - gather raised
        digest = hashlib.sha256(json.dumps(specs).encode()).hexdigest()
        given = None if version is None else str(version)
        rv.post(
            "layout", {"version": given, "digest": digest, "bad": bad, "module": module is not None}
        )
        given = agree(rv.gather("layout", self.deadline.fixed_s))
        return parts, module, given, state

    def _plan(self, parts, module, given: str | None) -> ShardedPlan:
        """2) rank 0 decides; every rank reads its decision."""
        rv = self.rendezvous
        if self.rank == 0:
            try:
                shapes = {p.name: (p.shape, p.dtype) for p, _ in parts}
                version = given if given is not None else self.torchrl.next_version()
                plan = make_plan(self.scheme, self.transport, shapes, module is not None, version)
            except Exception as e:
                rv.fail("plan", e)
            else:
                rv.post("plan", to_json(plan))
        return from_json(rv.one("plan", 0, self.deadline.fixed_s), ShardedPlan)

    def _write(self, parts, plan: ShardedPlan, deadline: float) -> dict[str, int]:
        """3) storage: every rank's blocks into the slot, then the checksums of the whole
        tensors, each rank its share by bytes; every tensor's checksum."""
        path = plan.slot.path
        self._step("wrote", deadline, lambda: self.blocks.write(path, self.rank, parts))
        # the full tensors' bytes (the same on every rank, unlike its blocks')
        owners = assign([nbytes_of(t) for t in plan.tensors], self.world)
        mine = [n for n, owner in zip(plan.names, owners, strict=True) if owner == self.rank]
        rv = self.rendezvous
        try:
            rv.post(
                "sums", {k: str(v) for k, v in self.blocks.checksums(path, self.rank, mine).items()}
            )
        except Exception as e:
            rv.fail("sums", e)
        sums = {}
        for posted in rv.gather("sums", deadline):
            sums.update({k: int(v) for k, v in posted.items()})
        return sums

    def _deliver(self, plan: ShardedPlan, done: RanksDone, deadline: float, state) -> SyncReport:
        """5) rank 0 has the scheme publish (or stream), pause, load, check and commit;
        every rank returns its report (or raises its error)."""
        rv = self.rendezvous
        if self.rank == 0:
            try:
                report = self._leader_push(plan, done, state)
            except Exception as e:
                rv.fail("result", e)
            else:
                rv.post("result", to_json(report))
        elif not plan.written:
            try:  # the gathers rank 0 sends from, in lockstep
                for _ in gathered(state, plan.tensors, plan.buckets, False, self.group):
                    pass
            except Exception as e:  # rank 0's push fails too: its gathers stop
                logger.error("rank %d: the streamed gather failed: %s", self.rank, e)
        # the scheme's steps: stage, pause and load, probe (each within this deadline)
        posted = rv.one("result", 0, 3 * deadline)
        return from_json(posted, SyncReport)

    def _leader_push(self, plan: ShardedPlan, done: RanksDone, state) -> SyncReport:
        """Rank 0's step 5: the scheme's push of what the ranks wrote (or stream); its
        report covers the whole sharded push (``seconds`` from the ranks' first step,
        their steps first in ``phases``)."""
        scheme, transport = self.scheme, self.transport
        if plan.written:
            prepare = functools.partial(transport.prepare_written, plan.manifest(done.sums))
            return scheme.service.run(scheme.apush_prepared(done.delivery(plan, prepare)))
        handoff = Handoff()
        header = plan.header()

        def stream(ready):
            return transport.prepare_streamed(header, handoff.taken(), ready)

        push = scheme.service.submit(scheme.apush_prepared(done.delivery(plan, stream)))
        try:
            buckets = gathered(state, plan.tensors, plan.buckets, True, self.group)
            handoff.feed(buckets, push.done)
        except Exception as e:
            logger.error("rank 0: the streamed gather failed: %s", e)
        return push.result()

    def close(self) -> None:
        """Drop this rank's mappings and its coordination keys (the scheme is the caller's);
        on rank 0, once every other rank closed (or a deadline passed), the store too."""
        self.blocks.close()
        self.rendezvous.close()

    def __enter__(self) -> ShardedWeightSync:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _sharded_state(weights) -> tuple[nn.Module | None, dict[str, torch.Tensor]]:
    """The module (None for a state dict) and its tensors, sharded as they are."""
    weights = unwrap(weights)
    peft = getattr(type(weights), "__module__", "").startswith("peft")
    if peft:
        raise WeightSyncError(
            "a sharded push of a PEFT model is not supported: merge the adapter into the base "
            "weights first (merge_and_unload), or push the adapter (AdapterSync)."
        )
    if isinstance(weights, nn.Module):
        return weights, {k: v.detach() for k, v in weights.state_dict().items()}
    if isinstance(weights, dict):
        return None, {str(k): v.detach() for k, v in weights.items()}
    raise WeightSyncError(
        f"a sharded push takes the sharded model (or its state dict of DTensors), not a "
        f"{type(weights).__name__}."
    )


def agree(layouts: list[dict]) -> str | None:
    """The checks of step 1, the same on every rank: one layout, one version, all finite;
    the version given (None: rank 0 picks it)."""
    digest = layouts[0]["digest"]
    differ = [r for r, lay in enumerate(layouts) if lay["digest"] != digest]
    if differ:
        raise ShardedPushError(
            f"rank(s) {differ} pushed parameters (names, shapes or dtypes) other than rank "
            "0's: every rank must push its shards of the same model, at the same step. "
            "Nothing was written; the replicas keep their weights.",
            tuple(differ),
        )
    given = {lay["version"] for lay in layouts} - {None}
    if len(given) > 1:
        ranks = tuple(r for r, lay in enumerate(layouts) if lay["version"] is not None)
        raise ShardedPushError(
            f"the ranks were given different versions {sorted(given)} (ranks {list(ranks)}); "
            "give every rank the same version, or only one. Nothing was written.",
            ranks,
        )
    bad = [(r, lay["bad"]) for r, lay in enumerate(layouts) if lay["bad"]]
    if bad:
        raise ShardedPushError(f"rank {bad[0][0]}: {bad[0][1]}", tuple(r for r, _ in bad))
    return given.pop() if given else None
