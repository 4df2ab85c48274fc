"""ShardedWeightSync: a push called by every rank of a sharded trainer (FSDP2 / DTensor).

Every rank calls :meth:`ShardedWeightSync.push` at the same point of its loop with its own
sharded model; rank 0 of the group holds the :class:`~..scheme.WeightSyncScheme` and talks
to the service; every rank returns the same :class:`~..report.SyncReport` or raises the
same :class:`~torchrl_vllm_ext.errors.ShardedPushError`. No rank gathers the model:

1. ``layout``: each rank posts its parameters' names, shapes and dtypes, the version it was
   given, and the first non-finite parameter of its shards; every rank checks them alike
   (ranks that disagree are named before anything is written);
2. ``plan`` (rank 0): the names checked against the served checkpoint, the version (the
   one given, else TorchRL's next), whether the value check runs, and for storage the idle
   slot, allocated in its file;
3. storage: every rank writes its blocks straight into the slot (``wrote``), then
   checksums the whole tensors it is given, balanced by bytes (``sums``); broadcast: the
   ranks gather bucket by bucket in lockstep and rank 0 sends each bucket as it completes
   (:mod:`.streamed`);
4. the value check's reference, when due: a collective forward on every rank;
5. rank 0 publishes the slot and runs the scheme's pause, load, check and commit
   (``WeightSyncScheme.apush_prepared``), then posts the ``result`` every rank returns.

Each step waits at most its deadline for every rank (:mod:`.rendezvous`): a rank that died
or never called the push is named, and nothing is published, so the replicas keep the last
version, as with a writer killed mid-write.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time

import torch
import torch.distributed as dist
from torch import nn

from torchrl_vllm_ext.deadlines import Deadline
from torchrl_vllm_ext.errors import ConfigurationError, ShardedPushError, WeightSyncError
from torchrl_vllm_ext.weight_sync.params import require_finite, torch_dtype
from torchrl_vllm_ext.weight_sync.report import SyncReport
from torchrl_vllm_ext.weight_sync.sharded.layout import assign, part_of
from torchrl_vllm_ext.weight_sync.sharded.rendezvous import Rendezvous
from torchrl_vllm_ext.weight_sync.sharded.routes import pushed_names, sharded_route
from torchrl_vllm_ext.weight_sync.sharded.storage import SlotBlocks
from torchrl_vllm_ext.weight_sync.sharded.streamed import (
    Handoff,
    bucket_plan,
    gathered,
    header_of,
)
from torchrl_vllm_ext.weight_sync.sources import unwrap
from torchrl_vllm_ext.weight_sync.specs import SlotManifest, TensorSpec, from_json, to_json
from torchrl_vllm_ext.weight_sync.torchrl.pushes import TorchRLPushes
from torchrl_vllm_ext.weight_sync.verify import collective_reference

logger = logging.getLogger(__name__)


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
        setup = None
        if scheme is not None:
            deadline = deadline or scheme.deadline
            route = sharded_route(scheme)
            setup = {"route": route, "fixed_s": deadline.fixed_s, "rate": deadline.min_bytes_per_s}
            self.rendezvous.post("setup", setup)
        setup = self.rendezvous.one("setup", 0, 600.0)
        self.route: str = setup["route"]
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
        parts = [pl for pl in parts if pl[0].name in plan["names"]]
        deadline = self.deadline.for_bytes(plan["nbytes"])
        phases = {"agree": time.perf_counter() - start}
        expected = None
        if plan["reference"] is not None:
            t0 = time.perf_counter()
            expected = self._step(
                "reference",
                deadline,
                lambda: collective_reference(module, plan["probe"], plan["reference"]),
            )
            phases["reference"] = time.perf_counter() - t0
        sums = None
        if self.route == "storage":
            t0 = time.perf_counter()
            sums = self._write(parts, plan, deadline)
            phases["ranks_write"] = time.perf_counter() - t0
        report = self._deliver(plan, sums, (expected, phases, start), deadline, state)
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

    def _plan(self, parts, module, given: str | None) -> dict:
        """2) rank 0 decides; every rank reads its decision."""
        rv = self.rendezvous
        if self.rank == 0:
            try:
                plan = self._make_plan(parts, module, given)
            except Exception as e:
                rv.fail("plan", e)
            else:
                rv.post("plan", plan)
        return rv.one("plan", 0, self.deadline.fixed_s)

    def _make_plan(self, parts, module, given: str | None) -> dict:
        scheme = self.scheme
        shapes = {p.name: (p.shape, p.dtype) for p, _ in parts}
        names = pushed_names(shapes, scheme.expected)
        version = given if given is not None else self.torchrl.next_version()
        ready = list(scheme.fleet.ready())
        reference = None
        if scheme.arrival.due():
            if module is None:
                raise WeightSyncError(
                    "the value check needs the sharded model (a collective forward on every "
                    "rank): push the model, not a state dict, or create the scheme with "
                    "verify='never'."
                )
            reference = scheme.arrival.served_dtype_name(ready)
        nbytes = sum(torch_dtype(shapes[n][1]).itemsize * math.prod(shapes[n][0]) for n in names)
        # The scheme's slots hold its served dtype when delta pushes are on (its 1-process
        # pushes write them so): the ranks' blocks are cast as they are written.
        stored = scheme.delta_dtype if self.route == "storage" else None
        plan = {
            "version": version,
            "names": names,
            "nbytes": nbytes,
            "reference": reference,
            "probe": scheme.arrival.probe,
            "specs": [[n, list(shapes[n][0]), stored or shapes[n][1]] for n in names],
        }
        if self.route == "broadcast":
            bucket_bytes = scheme.transport_impl.options.bucket_bytes
            plan["buckets"] = bucket_plan(plan["specs"], bucket_bytes)
        else:
            writer = scheme.transport_impl.writer
            layout = tuple((n, tuple(s), torch_dtype(d)) for n, s, d in plan["specs"])
            plan["slot"], path = writer.idle(layout)
            plan["path"] = str(path)
        return plan

    def _write(self, parts, plan: dict, deadline: float) -> dict[str, int] | None:
        """3) storage: every rank's blocks into the slot, then the checksums of the whole
        tensors, each rank its share by bytes; every tensor's checksum."""
        names = plan["names"]
        path = plan["path"]
        self._step("wrote", deadline, lambda: self.blocks.write(path, self.rank, parts))
        # the full tensors' bytes (the same on every rank, unlike its blocks')
        sizes = {n: math.prod(s) * torch_dtype(d).itemsize for n, s, d in plan["specs"]}
        owners = assign([sizes[n] for n in names], self.world)
        mine = [n for n, owner in zip(names, owners, strict=True) if owner == self.rank]
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

    def _deliver(self, plan: dict, sums, reference, deadline: float, state) -> SyncReport:
        """5) rank 0 publishes (or streams) and has the scheme pause, load, check and
        commit; every rank returns its report (or raises its error)."""
        rv = self.rendezvous
        if self.rank == 0:
            try:
                report = self._leader_push(plan, sums, reference, state)
            except Exception as e:
                rv.fail("result", e)
            else:
                rv.post("result", to_json(report))
        elif self.route == "broadcast":
            try:  # the gathers rank 0 sends from, in lockstep
                for _ in gathered(state, plan["specs"], plan["buckets"], False, self.group):
                    pass
            except Exception as e:  # rank 0's push fails too: its gathers stop
                logger.error("rank %d: the streamed gather failed: %s", self.rank, e)
        # the scheme's steps: stage, pause and load, probe (each within this deadline)
        posted = rv.one("result", 0, 3 * deadline)
        return from_json(posted, SyncReport)

    def _leader_push(self, plan: dict, sums, reference, state) -> SyncReport:
        """Rank 0's step 5: the scheme's push of what the ranks wrote (or stream); its
        report covers the whole sharded push (``seconds`` from the ranks' first step,
        their steps first in ``phases``)."""
        expected, phases, start = reference
        report = self._scheme_push(plan, sums, expected, phases.get("reference", 0.0), state)
        report.phases = {**phases, **report.phases}
        report.seconds = time.perf_counter() - start
        return report

    def _scheme_push(self, plan: dict, sums, expected, reference_s: float, state) -> SyncReport:
        scheme = self.scheme
        transport = scheme.transport_impl
        version = plan["version"]
        if self.route == "storage":
            specs = tuple(TensorSpec(n, d, tuple(s), sums[n]) for n, s, d in plan["specs"])
            manifest = SlotManifest(version=version, slot=plan["slot"], tensors=specs)

            def prepare(ready):
                return transport.prepare_written(manifest, ready)

            return scheme.service.run(
                scheme.apush_prepared(version, plan["nbytes"], prepare, expected, reference_s)
            )
        header = header_of(plan["specs"], plan["buckets"], version)
        handoff = Handoff()

        def stream(ready):
            return transport.prepare_streamed(header, handoff.taken(), ready)

        push = scheme.service.submit(
            scheme.apush_prepared(version, plan["nbytes"], stream, expected, reference_s)
        )
        try:
            buckets = gathered(state, plan["specs"], plan["buckets"], True, self.group)
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
