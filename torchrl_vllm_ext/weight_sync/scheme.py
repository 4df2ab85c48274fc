"""WeightSyncScheme: push trainer weights into every replica of a VLLMService, verifiably.

A push, as named steps (:meth:`WeightSyncScheme.apush`):

1. validate names, shapes and values, before any replica is touched (transformers'
   in-memory names, e.g. fused MoE experts, mapped onto the checkpoint's first);
2. ``transport.prepare``: the bytes reach the replicas while they keep generating
   (meanwhile, in a thread, the trainer's log-probs for the probe sequence);
3. on each replica: pause -> load -> verify version -> set version -> resume
   (``VLLMReplica.update_weights``), all at once or one replica at a time;
4. verify by value (``verify``: the scheme's first push by default, every push with
   ``"always"``): each loaded replica scores the probe after its pause; one whose
   log-probs differ from the trainer's failed the push and is restarted (it serves
   weights nobody pushed);
5. ``transport.commit`` (or ``rollback`` when no replica loaded), record the version,
   and become the service's weights provider for restarted replicas.

The scheme owns validation, the version, the order of pushes, the rollout policy and
the :class:`SyncReport`; the transports (:mod:`.transports`) own how bytes move. Every
push runs on the service's event loop under one ``asyncio.Lock``, the same loop on
which a restarted replica is brought up, so the two never interleave.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
import warnings
import weakref
from pathlib import Path

import torch

from torchrl_vllm_ext.deadlines import Deadline
from torchrl_vllm_ext.engine.calls import Outcomes
from torchrl_vllm_ext.engine.fleet import PushFleet, ReplicaView
from torchrl_vllm_ext.engine.serving import check_pause_mode
from torchrl_vllm_ext.errors import ConfigurationError, PartialLoadError, WeightSyncError
from torchrl_vllm_ext.weight_sync.arrival import ArrivalCheck
from torchrl_vllm_ext.weight_sync.checkpoint_names import CheckpointNames
from torchrl_vllm_ext.weight_sync.delivery import Delivery
from torchrl_vllm_ext.weight_sync.params import expected_specs, torch_dtype, validate
from torchrl_vllm_ext.weight_sync.report import SyncReport
from torchrl_vllm_ext.weight_sync.sources import PushSource, full_push_source
from torchrl_vllm_ext.weight_sync.torchrl.pushes import TorchRLPushes
from torchrl_vllm_ext.weight_sync.torchrl.scheme_contract import (
    SchemeContract,
    register_with_torchrl,
)
from torchrl_vllm_ext.weight_sync.transport_choice import choose_transport, delta_dtype
from torchrl_vllm_ext.weight_sync.transports import registry
from torchrl_vllm_ext.weight_sync.transports.packing import DEFAULT_BUCKET_BYTES
from torchrl_vllm_ext.weight_sync.transports.protocol import Replicas, TransportOptions
from torchrl_vllm_ext.weight_sync.verify import TimedReference

logger = logging.getLogger(__name__)

ROLLOUTS = ("parallel", "rolling")


class WeightSyncScheme:
    """Pushes trainer weights into every replica of a :class:`~torchrl_vllm_ext.VLLMService`.

    Args:
        service: the running service.
        transport: a name of :mod:`~torchrl_vllm_ext.weight_sync.transports.registry`:
            ``"auto"`` (the default: storage or gloo on CPU replicas, a route per replica on
            GPUs), ``"storage"`` (memory-mapped A/B slots read by
            ``load_weights_from_storage``), ``"broadcast"`` (packed buckets over NCCL or
            gloo) or ``"ipc"`` (CUDA IPC, replicas on the trainer's GPU).
        storage_dir: root of the storage slots (default: a private tmpfs directory);
            on a multi-host cluster, a directory every host shares.
        bucket_bytes: broadcast bucket size.
        pause_mode: how replicas pause during the load: ``abort``, ``wait`` or ``keep``.
        timeout: seconds, the fixed part of every deadline of a push (``deadline.fixed_s``;
            ``timeout_s``, the old name, still works and warns).
        deadline: how long each step of a push may wait on a replica:
            ``fixed_s + bytes / min_bytes_per_s`` (:class:`~torchrl_vllm_ext.Deadline`;
            default 60 s + 20 s per GB). A replica that has not answered by then (dead,
            frozen, stuck in a collective) is killed, restarted at the live version and
            named in a :class:`WeightSyncError`. With ``pause_mode="wait"`` the load
            step waits for running requests, so it has no deadline.
        rollout: ``"parallel"`` loads every replica at once (shortest push);
            ``"rolling"`` (storage only) loads one replica at a time, so the others keep
            serving and each pause is shorter on machines the replicas share.
        verify: when to check arrival by value: ``"first"`` (the scheme's first push
            that succeeds, the default: what catches a model whose reload vLLM gets
            wrong), ``"always"`` (every push) or ``"never"``; ``True`` / ``False`` mean
            ``"always"`` / ``"never"``. A checked push has every replica's log-probs for
            a fixed probe sequence equal the trainer model's (the pushed module, or for
            tensors a transformers copy of the served model: one more copy of the
            weights in this process); a replica that fails is restarted and the push
            raises :class:`WeightSyncError`. It costs one forward pass here and one per
            replica (measured: docs/architecture.md, "Cost of the value check").
        verify_tol: mean |log-prob gap| allowed over the probe; default: derived at each
            push, 1e-3 for replicas serving float32, and for 16-bit replicas 3 times the
            push's own rounding noise (the trainer scores the probe with the pushed weights
            in float32 and in the served dtype; ``SyncReport.probe_noise``), at least 1e-3.
        delta: push only what changed (:mod:`~torchrl_vllm_ext.weight_sync.delta`):
            ``"auto"`` (the default) for 16-bit replicas on ``storage`` and ``broadcast``;
            ``True`` on those transports whatever the served dtype; ``False``: every push
            sends every byte, as given. With deltas on, every push is cast to the served
            dtype (what the replicas would round it to); a broadcast sends, where every
            replica holds the last version, only the values whose bits changed and their
            positions (a tensor mostly changed goes whole; a delta hardly smaller than the
            push goes as a full push), and each worker checks the buckets it rebuilt against
            the sender's checksums; storage writes whole slots of the served dtype (a delta
            gains nothing there: :mod:`~torchrl_vllm_ext.weight_sync.delta`).
            ``SyncReport.sent_bytes`` says what moved.
        per_worker_sends: ``broadcast`` to tensor-parallel replicas over gloo: once each
            worker's load plan of the push's layout is traced, send each worker only the
            bytes it keeps (its slices; the tensors it keeps whole, whole), point to point,
            instead of every byte to every worker (``SyncReport.sends`` says which, and
            why; ``SyncReport.reads`` what each worker received against what it keeps).
            Off by default (every push one broadcast of every byte): on one host, where
            the "wire" is a memory copy, cutting and writing back the slices costs more
            than the bytes saved (``benchmarks/bench_slices.py --parts broadcast``).

    Examples:
        >>> scheme = WeightSyncScheme(service, transport="storage")  # doctest: +SKIP
        >>> scheme.push(trainer_model, version=1).version  # doctest: +SKIP
        '1'
    """

    def __init__(
        self,
        service,
        transport: str = "auto",
        *,
        storage_dir: str | Path | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        pause_mode: str = "abort",
        timeout: float | None = None,
        rollout: str = "parallel",
        timeout_s: float | None = None,
        deadline: Deadline | None = None,
        verify: bool | str = "first",
        verify_tol: float | None = None,
        delta: bool | str = "auto",
        per_worker_sends: bool = False,
    ):
        if timeout_s is not None:  # one rule: a duration argument is `timeout`, in seconds
            warnings.warn(
                "WeightSyncScheme(timeout_s=...) is deprecated; pass timeout= (seconds).",
                DeprecationWarning,
                stacklevel=2,
            )
            timeout = timeout_s
        if rollout not in ROLLOUTS:
            raise ConfigurationError(f"rollout={rollout!r} is not one of {ROLLOUTS}.")
        check_pause_mode(pause_mode)
        self.expected = expected_specs(service.config.model)
        self.names = CheckpointNames(service.config.model, self.expected)
        self.fleet: PushFleet = service.pool
        """The replicas, as a push sees them (every replica call goes through it)."""
        self.arrival = ArrivalCheck(self.fleet, service.config, self.names, verify, verify_tol)
        deadline = deadline or Deadline()
        if timeout is not None:
            deadline = Deadline(fixed_s=timeout, min_bytes_per_s=deadline.min_bytes_per_s)
        self.deadline = deadline
        self.service = service
        name, self._reason = choose_transport(self.fleet, transport, storage_dir)
        self.delta_dtype = delta_dtype(delta, name, self.arrival.served_dtype_or_mixed())
        """The dtype delta pushes compare in (None: every push is sent whole)."""
        self.transport_impl = registry.make_transport(
            name,
            self.fleet,
            TransportOptions(
                bucket_bytes=bucket_bytes,
                deadline=deadline,
                storage_dir=storage_dir,
                delta_dtype=self.delta_dtype,
                per_worker_sends=per_worker_sends,
            ),
        )
        if rollout == "rolling" and not self.transport_impl.loads_one_at_a_time:
            self.transport_impl.close()  # nothing of a refused scheme stays
            raise ConfigurationError(
                f"rollout='rolling' needs a transport whose replicas load one at a time; "
                f"{name!r} reaches every replica in one collective. Use rollout='parallel' or "
                "transport='storage'."
            )
        self.pause_mode = pause_mode
        self.rollout = rollout
        self._unhook = self.fleet.when_serving(_weak_hook(self._check_deferred))
        self.version: str | None = None
        self._nbytes = 0
        self.last_report: SyncReport | None = None
        self._lock = asyncio.Lock()
        self.torchrl = TorchRLPushes(self.push, lambda: self.fleet.weight_version)
        """Every push from TorchRL's entry points (this scheme's hooks, the updater, the
        engine calls), versioned in one place."""
        self.torchrl_contract = SchemeContract(
            self.torchrl, lambda: self.service.run(self.aconnect())
        )
        """TorchRL's ``WeightSyncScheme`` calls (a collector's ``weight_sync_schemes=``) and
        their state; the scheme's methods of the same names delegate to it."""
        logger.info(
            "weight sync transport: %s (%s)%s",
            name,
            self.reason,
            f"; delta pushes in {self.delta_dtype}" if self.delta_dtype else "",
        )

    @property
    def transport(self) -> str:
        """The transport's name: ``storage``, ``broadcast``, ``ipc`` or, planned on GPUs,
        the last push's routes (``ipc+nccl``; ``auto`` before the first push)."""
        return self.transport_impl.label

    @property
    def reason(self) -> str:
        """Why this transport: for a planned one, the last push's route of every replica."""
        return self.transport_impl.reason or self._reason

    @property
    def storage_dir(self) -> Path | None:
        """The storage slots' root (storage transport), else None."""
        return self.transport_impl.storage_dir

    # ------------------------------------------------------------------ push
    def push(self, weights, version: str | int) -> SyncReport:
        """Push ``weights`` as ``version``; blocks.

        ``weights``: the trainer's transformers model, TorchRL's ``TransformersWrapper``
        around it, a PEFT model (LoRA merged into the base weights, the model untouched),
        a state dict or a TensorDict, with Hugging Face names.

        Raises :class:`WeightSyncError` naming the parameter for missing, extra,
        wrongly shaped or non-finite weights; then nothing was sent and every replica
        keeps serving its previous version.
        """
        return self.service.run(self.apush(weights, version))

    def push_async(self, weights, version: str | int) -> concurrent.futures.Future:
        """Like :meth:`push` but returns a future; pushes run one at a time, in order."""
        return self.service.submit(self.apush(weights, version))

    async def apush(self, weights, version: str | int) -> SyncReport:
        """The push, on the service's event loop (see the module docstring)."""
        async with self._lock:
            report = await self._push(weights, str(version))
        self.last_report = report
        logger.debug(
            "pushed version %s via %s: %.1f MB in %.3fs (%.2f GB/s), max pause %.3fs",
            report.version,
            report.transport,
            report.nbytes / 1e6,
            report.seconds,
            report.gb_per_s,
            max(report.pause_s.values(), default=0.0),
        )
        return report

    async def _push(self, weights, version: str) -> SyncReport:
        transport = self.transport_impl
        arrival = self.arrival
        arrival.supersede()
        start = time.perf_counter()
        source = await asyncio.to_thread(full_push_source, weights)

        def validated() -> dict[str, torch.Tensor]:
            named = self._checkpoint_named(source)
            # Checkpoint tensors no parameter holds (GPT-2's mask buffers) may be left out.
            optional = self.names.stale(named)
            return validate(named, self.expected, not transport.checks_finite, optional)

        tensors = await asyncio.to_thread(validated)  # 1) validate
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        validate_s = time.perf_counter() - start
        ready = list(self.fleet.ready())
        push = Delivery(
            version,
            nbytes,
            lambda replicas: transport.prepare(tensors, version, replicas),
            arrival.start_reference(source.scorer, tensors, ready),
            {"validate": validate_s},
            start,
        )
        return await self._deliver(push, ready)

    async def apush_prepared(self, push: Delivery) -> SyncReport:
        """A push whose bytes were made ready elsewhere (a sharded trainer's ranks,
        :mod:`.sharded`): ``push.prepare(ready)`` is its transfer step, ``push.reference``
        the value check's reference the ranks computed (None: unchecked); then the same
        pause, check, commit and report as :meth:`apush`, the report counting from
        ``push.start`` with ``push.phases`` (the ranks' steps) first."""
        async with self._lock:
            self.arrival.supersede()
            report = await self._deliver(push, list(self.fleet.ready()))
        self.last_report = report
        return report

    async def _deliver(self, push: Delivery, ready: Replicas) -> SyncReport:
        """2) to 5) of ``push`` to the ``ready`` replicas (see the module docstring)."""
        transport = self.transport_impl
        arrival = self.arrival
        version, nbytes = push.version, push.nbytes
        self._nbytes = nbytes  # what a restarted replica loads (its bring-up deadline)
        try:
            prepared = await push.prepare(ready)  # 2) transfer
        except BaseException:
            await push.drop_reference()
            raise
        replicas = prepared.reached(ready)
        if not replicas:
            await push.drop_reference()
            await transport.rollback(version)
            raise WeightSyncError(
                f"every replica died while version {version} was sent; nothing serves it. "
                "The service restarts them at the previous version; push again."
            )
        timed = await self._reference_or_rollback(push, version)
        expected = timed.reference if timed is not None else None
        t_apply = time.perf_counter()
        loads, verify_s = await self._apply(replicas, prepared.calls, version, nbytes, expected)
        phases = {**push.phases, **prepared.phases}
        if timed is not None:
            phases["reference"] = timed.seconds
        phases["apply"] = time.perf_counter() - t_apply  # 3) + 4)
        if expected is not None:
            phases["verify"] = verify_s
        phases["load"] = max((t["load_s"] for t in loads.results.values()), default=0.0)
        if not loads.results:  # 5) commit or roll back
            await transport.rollback(version)
            raise self._load_error(loads, version, loaded=[])
        await transport.commit(version)
        self.version = version
        if expected is not None and arrival.deferred is None:
            arrival.verified()
        self.fleet.set_provider(self)
        if loads.errors:
            raise self._load_error(loads, version, loaded=sorted(loads.results))
        pauses = {rid: t["pause_s"] for rid, t in loads.results.items()}
        gaps = {rid: t["probe_gap"] for rid, t in loads.results.items() if "probe_gap" in t}
        deferred = sorted(arrival.deferred.replicas) if arrival.deferred else []
        reports = {rid: list(t.get("loads", [])) for rid, t in loads.results.items()}
        return SyncReport(
            version,
            transport.label,
            nbytes,
            time.perf_counter() - push.start,
            pauses,
            phases,
            gaps,
            prepared.staged_in,
            deferred,
            probe_limit=arrival.limit(expected) if expected is not None else None,
            probe_noise=expected.noise if expected is not None else None,
            loads=reports,
            sent_bytes=nbytes if prepared.sent_bytes is None else prepared.sent_bytes,
            base=prepared.base,
            sends=prepared.sends[0] if prepared.sends else None,
            sends_why=prepared.sends[1] if prepared.sends else None,
        )

    def _checkpoint_named(self, source: PushSource) -> dict[str, torch.Tensor]:
        """The pushed tensors under the checkpoint's names (transformers' fused names mapped)."""
        tensors = source.tensors
        if self.names.needed(tensors):
            tensors = self.names.to_checkpoint(tensors, source.module)
        return tensors

    async def _reference_or_rollback(self, push: Delivery, version: str) -> TimedReference | None:
        """The trainer's probe log-probs, awaited before any replica loads: a model the
        check cannot run fails the push while every replica still serves its weights."""
        try:
            return await push.taken_reference()
        except Exception as e:
            await self.transport_impl.rollback(version)
            raise WeightSyncError(
                f"version {version}: the trainer's log-probs for the value check could not be "
                f"computed ({type(e).__name__}: {e}); nothing was loaded. Push the transformers "
                "model (or its state dict), or pass verify='never'."
            ) from e

    async def _check_deferred(self, ready) -> None:
        """A push's deferred value check, once the service serves again (the pool's
        ``when_serving`` hook), under the push lock."""
        async with self._lock:
            await self.arrival.check_deferred(ready, self.version)

    # The value check's settings and count, as the scheme's own attributes.
    verify = property(
        lambda self: self.arrival.mode,
        lambda self, mode: setattr(self.arrival, "mode", mode),
        doc="When arrival is checked by value: ``first``, ``always`` or ``never``.",
    )
    verify_tol = property(
        lambda self: self.arrival.tol,
        lambda self, tol: setattr(self.arrival, "tol", tol),
        doc="A fixed limit on the probe's mean gap (None: derived at each push).",
    )
    verified_pushes = property(
        lambda self: self.arrival.verified_pushes, doc="Pushes whose value check passed."
    )

    async def _apply(
        self,
        replicas: Replicas,
        calls: dict,
        version: str,
        nbytes: int,
        expected=None,
    ) -> tuple[Outcomes, float]:
        """3) + 4): every replica's pause call, then the value check of those that loaded;
        the outcomes and the seconds the checks took."""
        # "wait" drains running requests first: no bound on that part of the pause.
        deadline = None if self.pause_mode == "wait" else self.deadline.for_bytes(nbytes)

        def update(view: ReplicaView):
            mine = calls[view.replica_id]
            return view.handle.update_weights.remote(
                mine.method, mine.args, version, self.pause_mode
            )

        async def load(group: Replicas) -> tuple[Outcomes, float]:
            loaded = await self.fleet.call_each(update, group, "update_weights", deadline=deadline)
            for view in group:  # half-written weights: restarted, as a failed value check
                cause = loaded.errors.get(view.replica_id)
                if isinstance(cause, PartialLoadError):  # the pool logs it with the restart
                    self.fleet.restart_untrusted(view, cause, "partial load")
            verdict = await self.arrival.check(loaded, expected, version)
            return verdict.applied_to(loaded), verdict.seconds

        if self.rollout == "parallel":
            return await load(replicas)
        out, seconds = Outcomes(), 0.0  # rolling: one replica at a time, the others serve
        for one in replicas:
            step, step_s = await load([one])
            seconds += step_s
            out.results.update(step.results)
            out.dead.update(step.dead)
            out.errors.update(step.errors)
            if step.errors:
                break
        return out, seconds

    @staticmethod
    def _load_error(loads: Outcomes, version: str, loaded: list[int]) -> WeightSyncError:
        if not loads.errors:
            return WeightSyncError(
                f"every replica died while loading version {version}; nothing serves it. "
                "The service restarts them at the previous version; push again."
            )
        rid, cause = next(iter(loads.errors.items()))
        serving = (
            f"replicas {loaded} loaded it and serve it; the others keep their previous weights"
            if loaded
            else "no replica loaded it; every replica keeps its previous weights"
        )
        partial = sorted(r for r, c in loads.errors.items() if isinstance(c, PartialLoadError))
        if partial:
            serving += (
                f" (replicas {partial} had begun writing it: they are restarted at the "
                "version the service serves)"
            )
        return WeightSyncError(
            f"load of version {version} failed on replica {rid}: {cause}; {serving}. Push again."
        )

    async def aconnect(self) -> None:
        """Set up what every push uses before the first one (a broadcast forms its group)."""
        nbytes = sum(
            torch_dtype(s.dtype).itemsize * math.prod(s.shape) for s in self.expected.values()
        )
        async with self._lock:
            await self.transport_impl.connect(list(self.fleet.ready()), nbytes)

    # ------------------------------------------------------------------ restarts
    async def bring_up(self, replica: ReplicaView) -> str | None:
        """The service's weights provider: load the current version into a restarted replica;
        returns that version (None: this scheme is no longer the provider, nothing loaded).

        Under the push lock: a push in flight (perhaps the one this replica died in)
        records its version first, and this replica then loads that version.
        """
        async with self._lock:
            if self.version is None or self.fleet.provider is not self:
                return None
            await asyncio.wait_for(  # a restart whose load hangs is retried by the pool
                self.transport_impl.bring_up(replica, self.version),
                self.deadline.for_bytes(self._nbytes),
            )
            await replica.handle.set_weight_version.remote(self.version)
            await replica.handle.reset_prefix_cache.remote()  # the weights changed
            logger.info(
                "restarted replica %d brought to weight version %s",
                replica.replica_id,
                self.version,
            )
            return self.version

    def close(self) -> None:
        """Release the transport and stop bringing restarted replicas up to date.

        A replica started afterwards (a restart, an added replica) holds the checkpoint's
        weights under the checkpoint's label, and takes no requests until a push brings it
        to the live version (``ServiceConfig.allow_mixed_versions``: it serves under its own
        label); the replicas serving now keep serving this scheme's last version.
        """
        self._unhook()
        if self.fleet.provider is self:
            logger.info(
                "closing the weight-sync scheme whose version %s is live: a replica started "
                "from now on holds the checkpoint's weights, labelled as the checkpoint, and "
                "takes no requests until a push brings it to the live version (unless the "
                "service allows mixed versions)",
                self.version,
            )
            self.fleet.set_provider(None)
        self.transport_impl.close()

    # ------------------------------------------------------------------ TorchRL's contract
    # A collector given weight_sync_schemes= calls these: one line into the part.
    def init_on_sender(self, **kwargs) -> None:
        """:meth:`.SchemeContract.init_on_sender`: bind to a collector (and a model)."""
        self.torchrl_contract.init_on_sender(**kwargs)

    def connect(self, *, worker_idx: int | None = None, weights=None) -> None:
        """:meth:`.SchemeContract.connect`: prepare the transport; push ``weights`` if given."""
        self.torchrl_contract.connect(worker_idx=worker_idx, weights=weights)

    def send(self, weights=None, worker_ids=None) -> SyncReport:
        """:meth:`.SchemeContract.send`: push as the collector's next policy version."""
        return self.torchrl_contract.send(weights, worker_ids)

    def init_on_receiver(self, *args, **kwargs) -> None:
        """Refused (:meth:`.SchemeContract.init_on_receiver`): no receiver side."""
        self.torchrl_contract.init_on_receiver(*args, **kwargs)

    def shutdown(self) -> None:
        """TorchRL's name for :meth:`close`."""
        self.close()

    model_id = property(lambda self: self.torchrl_contract.model_id, doc="TorchRL's model id.")
    initialized_on_sender = property(
        lambda self: self.torchrl_contract.initialized_on_sender,
        doc="Whether TorchRL's ``init_on_sender`` ran.",
    )
    synchronized_on_sender = property(
        lambda self: self.torchrl_contract.synchronized_on_sender,
        doc="Whether TorchRL's ``connect`` ran.",
    )

    def __enter__(self) -> WeightSyncScheme:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _weak_hook(method):
    """``method`` as a pool hook that does not keep its scheme alive (a scheme nobody
    closes is freed with its transport like any object)."""
    ref = weakref.WeakMethod(method)

    async def hook(ready) -> None:
        bound = ref()
        if bound is not None:
            await bound(ready)

    return hook


register_with_torchrl(WeightSyncScheme)
