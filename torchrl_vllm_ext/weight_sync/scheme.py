"""WeightSyncScheme: push trainer weights into every replica of a VLLMService, verifiably.

A push is: validate (before anything is touched) -> transfer -> on each replica
pause -> load -> verify -> set version -> resume (``VLLMReplica.update_weights``).
The storage transport writes and stages before the pause, so the pause covers
only the in-memory load.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch

from torchrl_vllm_ext.engine.replica import PAUSE_MODES
from torchrl_vllm_ext.errors import ConfigurationError, ReplicaDeadError, WeightSyncError
from torchrl_vllm_ext.weight_sync.broadcast import (
    DEFAULT_BUCKET_BYTES,
    BroadcastGroup,
    header_to_json,
    listen,
    pack,
)
from torchrl_vllm_ext.weight_sync.params import (
    expected_specs,
    named_tensors,
    require_finite,
    validate,
)
from torchrl_vllm_ext.weight_sync.storage import SlotWriter

logger = logging.getLogger(__name__)

TRANSPORTS = ("auto", "broadcast", "storage")
ROLLOUTS = ("parallel", "rolling")
_DEATH_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


@dataclass
class SyncReport:
    """What one push did and how long it took."""

    version: str
    """The version now served by every replica."""
    transport: str
    """``storage`` or ``broadcast``."""
    nbytes: int
    """Bytes of weights pushed."""
    seconds: float
    """From ``push`` to every replica serving the new version."""
    pause_s: dict[int, float] = field(default_factory=dict)
    """Per replica: how long generation was paused."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase. Storage: validate, write (copy, finiteness and checksums in one
    pass), stage (replicas checksum the slot), apply (pause, load, resume), load (the
    slowest replica's load inside its pause). Broadcast: validate, pack, send (workers
    receive and verify while generating), apply, load."""

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9


def choose_transport(service, requested: str, shared_dir) -> tuple[str, str]:
    """Pick the transport for ``auto``; returns (transport, reason)."""
    if requested not in TRANSPORTS:
        raise ConfigurationError(f"transport={requested!r} is not one of {TRANSPORTS}.")
    if requested != "auto":
        return requested, "requested explicitly"
    if torch.cuda.is_available() and service.uses_gpu:
        return "broadcast", "the trainer and every replica have CUDA: NCCL broadcast"
    if shared_dir is not None:
        return "storage", f"a shared directory was given ({shared_dir})"
    here = ray.util.get_node_ip_address()
    hosts = {service.replica_info(r).node_ip for r in service.replica_ids}
    if hosts <= {here}:
        return "storage", f"the trainer and every replica share host {here}"
    return (
        "broadcast",
        f"replicas on other hosts {sorted(hosts - {here})} and no shared directory: gloo broadcast",
    )


class WeightSyncScheme:
    """Pushes trainer weights into every replica of a :class:`~torchrl_vllm_ext.VLLMService`.

    Args:
        service: the running service.
        transport: ``"auto"``, ``"broadcast"`` (packed buckets over NCCL or gloo) or
            ``"storage"`` (memory-mapped A/B slots read by ``load_weights_from_storage``).
        storage_dir: root of the storage slots (default: a private tmpfs directory);
            on a multi-host cluster, a directory every host shares.
        bucket_bytes: broadcast bucket size.
        pause_mode: how replicas pause during the load: ``abort``, ``wait`` or ``keep``.
        timeout_s: collective timeout of the broadcast group.
        rollout: ``"parallel"`` loads every replica at once (shortest push);
            ``"rolling"`` (storage only) loads one replica at a time, so the others keep
            serving and each pause is shorter on machines the replicas share.

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
        timeout_s: float = 300.0,
        rollout: str = "parallel",
    ):
        if rollout not in ROLLOUTS:
            raise ConfigurationError(f"rollout={rollout!r} is not one of {ROLLOUTS}.")
        if pause_mode not in PAUSE_MODES:
            raise ConfigurationError(f"pause_mode={pause_mode!r} is not one of {PAUSE_MODES}.")
        self.service = service
        self.transport, self.reason = choose_transport(service, transport, storage_dir)
        if rollout == "rolling" and self.transport == "broadcast":
            raise ConfigurationError(
                "rollout='rolling' needs the storage transport: a broadcast reaches every replica "
                "in one collective. Use rollout='parallel' or transport='storage'."
            )
        self.backend = "nccl" if torch.cuda.is_available() and service.uses_gpu else "gloo"
        self.pause_mode = pause_mode
        self.rollout = rollout
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.expected = expected_specs(service.config.model)
        self.version: str | None = None
        self.last_report: SyncReport | None = None
        self._lock = threading.Lock()
        self._writer = SlotWriter(storage_dir) if self.transport == "storage" else None
        self._group: BroadcastGroup | None = None
        self._members: tuple = ()
        self._last_update: tuple[str, list[torch.Tensor]] | None = None  # broadcast: for restarts
        self._loaded_any = False  # whether the push in flight reached a replica's weights
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-sync")
        service.add_restart_hook(self._bring_up_to_date)
        logger.info("weight sync transport: %s (%s)", self.transport, self.reason)

    @property
    def storage_dir(self) -> Path | None:
        return self._writer.root if self._writer is not None else None

    # ------------------------------------------------------------------ push
    def push(self, weights, version: str | int) -> SyncReport:
        """Push ``weights`` (nn.Module, state dict or TensorDict, HF names) as ``version``; blocks.

        Raises :class:`WeightSyncError` naming the parameter for missing, extra,
        wrongly shaped or non-finite weights; then nothing was sent and every replica
        keeps serving its previous version.
        """
        version = str(version)
        start = time.perf_counter()
        # The storage writer checks finiteness in its copy pass (one pass over the bytes).
        tensors = validate(
            named_tensors(weights), self.expected, check_finite=self.transport != "storage"
        )
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        phases = {"validate": time.perf_counter() - start}
        with self._lock:
            if self.transport == "storage":
                pauses = self._push_storage(tensors, version, phases)
            else:
                pauses = self._push_broadcast(tensors, version, phases)
            self.version = version
            self.service.record_weight_version(version, source=self)
        report = SyncReport(
            version, self.transport, nbytes, time.perf_counter() - start, pauses, phases
        )
        self.last_report = report
        logger.info(
            "pushed version %s via %s: %.1f MB in %.3fs (%.2f GB/s), max pause %.3fs",
            version,
            self.transport,
            nbytes / 1e6,
            report.seconds,
            report.gb_per_s,
            max(pauses.values(), default=0.0),
        )
        return report

    def push_async(self, weights, version: str | int) -> concurrent.futures.Future:
        """Like :meth:`push` but returns a future; pushes run one at a time, in order."""
        return self._pool.submit(self.push, weights, version)

    def _replicas(self) -> list[tuple[int, object]]:
        return [(rid, self.service.replica_handle(rid)) for rid in self.service.replica_ids]

    def _on_all(self, replicas: list, method: str, args: tuple, version: str) -> list:
        """Call a worker-extension method on every worker of every replica (see :meth:`_gather`)."""
        refs = [h.collective_rpc.remote(method, args) for _, h in replicas]
        return list(self._gather(replicas, refs, method, version).values())

    def _gather(
        self, replicas: list, refs: list, what: str, version: str, allow_none: bool = False
    ) -> dict[int, object]:
        """Results of one call per replica, by replica id.

        A replica that died is dropped from ``replicas`` (in place) and the push goes on
        without it: the service restarts it, and the restart hook, which waits for this
        push, loads the version the push records. Any other failure is a
        :class:`WeightSyncError` naming the replica. A broadcast cannot lose a member
        (the collective would break), so there a death is an error too.
        """
        results, dead = {}, []
        for (rid, _), ref in zip(list(replicas), refs, strict=True):
            try:
                results[rid] = ray.get(ref)
            except _DEATH_ERRORS as e:
                logger.warning(
                    "replica %d died during %s of version %s (%s); it restarts at the version "
                    "this push records",
                    rid,
                    what,
                    version,
                    type(e).__name__,
                )
                dead.append(rid)
            except ray.exceptions.RayTaskError as e:
                if isinstance(e, ReplicaDeadError):
                    dead.append(rid)
                    continue
                raise WeightSyncError(
                    f"{what} of version {version} failed on replica {rid}: {e}"
                ) from e
        replicas[:] = [(rid, h) for rid, h in replicas if rid not in dead]
        if dead and self.transport == "broadcast":
            self._drop_group()
            raise WeightSyncError(
                f"replica(s) {dead} died during {what} of version {version}; the broadcast "
                "group is broken, so no replica loaded it. The service restarts the dead "
                "replica(s); push again."
            )
        if not replicas and not allow_none:
            raise WeightSyncError(
                f"every replica died during {what} of version {version}; nothing serves it. "
                "The service restarts them at the previous version; push again."
            )
        return results

    def _apply(
        self, replicas, method: str, args: tuple, version: str, phases: dict
    ) -> dict[int, float]:
        def start(handle):
            return handle.update_weights.remote(method, args, version, self.pause_mode)

        self._loaded_any = False
        if self.rollout == "rolling":  # one replica at a time: the others keep serving
            timings = {}
            for rid, h in list(replicas):
                one = [(rid, h)]
                timings.update(self._gather(one, [start(h)], "load", version, allow_none=True))
                self._loaded_any = bool(timings)
            replicas[:] = [(rid, h) for rid, h in replicas if rid in timings]
            if not timings:
                raise WeightSyncError(
                    f"every replica died while loading version {version}; nothing serves it. "
                    "The service restarts them at the previous version; push again."
                )
        else:
            refs = [start(h) for _, h in replicas]
            timings = self._gather(replicas, refs, "load", version)
        self._loaded_any = True
        phases["load"] = max((t["load_s"] for t in timings.values()), default=0.0)
        return {rid: t["pause_s"] for rid, t in timings.items()}

    def _push_storage(self, tensors, version: str, phases: dict) -> dict[int, float]:
        t0 = time.perf_counter()
        self._loaded_any = False
        previous = self._writer.published()
        self._writer.write(tensors, version, check=require_finite)
        t_write = time.perf_counter()
        root = str(self._writer.root)
        replicas = self._replicas()
        try:
            # Each replica actor checksums the new slot while its engine keeps generating;
            # in the pause the workers only copy it in.
            refs = [h.stage_storage.remote(root, version) for _, h in replicas]
            self._gather(replicas, refs, "stage", version)
            t1 = time.perf_counter()
            pauses = self._apply(
                replicas, "load_weights_from_storage", (root, version, True), version, phases
            )
        except WeightSyncError:
            if previous is not None and not self._loaded_any:
                # No replica serves the new slot: publish the last complete version again,
                # so restarted replicas (which load the published slot) agree with the rest.
                self._writer.publish(previous)
            raise
        phases.update(write=t_write - t0, stage=t1 - t_write, apply=time.perf_counter() - t1)
        return pauses

    def _push_broadcast(self, tensors, version: str, phases: dict) -> dict[int, float]:
        t0 = time.perf_counter()
        header, buffers = pack(tensors, version, self.bucket_bytes)
        header_json = header_to_json(header)
        t_pack = time.perf_counter()
        replicas = self._replicas()
        self._ensure_group(replicas)
        # Workers receive and verify in a background thread while still generating;
        # only the load pauses.
        self._on_all(replicas, "stage_weight_broadcast", (header_json,), version)
        try:
            self._group.send(buffers)
        except Exception as e:
            self._drop_group()
            raise WeightSyncError(
                f"broadcast of version {version} failed: {e}; replicas keep their weights."
            ) from e
        self._wait_staged(replicas, version)
        t1 = time.perf_counter()
        pauses = self._apply(replicas, "load_staged_weights", (version,), version, phases)
        phases.update(pack=t_pack - t0, send=t1 - t_pack, apply=time.perf_counter() - t1)
        self._last_update = (header_json, buffers)
        return pauses

    def _wait_staged(self, replicas, version: str) -> None:
        while not all(
            all(r) for r in self._on_all(replicas, "staged_weights_ready", (version,), version)
        ):
            time.sleep(0.005)

    # ------------------------------------------------------------------ group
    def _workers_per_replica(self) -> int:
        cfg = self.service.config
        return cfg.tensor_parallel_size * cfg.pipeline_parallel_size

    def _form_group(self, handles) -> BroadcastGroup:
        host = ray.util.get_node_ip_address()
        listener = listen(host)  # bound before the workers are told its port: no race
        port = listener.getsockname()[1]
        n = self._workers_per_replica()
        world = 1 + n * len(handles)
        refs = [
            h.collective_rpc.remote(
                "init_weight_broadcast",
                (host, port, world, 1 + i * n, self.backend, self.timeout_s),
            )
            for i, h in enumerate(handles)
        ]
        group = BroadcastGroup(self.backend, host, port, world, self.timeout_s, listener)
        ray.get(refs)
        return group

    def _ensure_group(self, replicas) -> None:
        members = tuple((rid, self.service.replica_info(rid).pid) for rid, _ in replicas)
        if self._group is not None and members == self._members:
            return
        self._drop_group()
        self._group = self._form_group([h for _, h in replicas])
        self._members = members

    def _drop_group(self) -> None:
        if self._group is not None:
            for rid, _ in self._members:
                if rid in self.service.replica_ids:
                    self.service.replica_handle(rid).collective_rpc.remote("close_weight_broadcast")
            self._group.close()
        self._group, self._members = None, ()

    # ------------------------------------------------------------------ restarts
    async def _bring_up_to_date(self, service, rid: int) -> None:
        """Restart hook: load the current weights into a new replica before it serves."""
        # Under the lock: a push in flight (perhaps the one this replica died in) records
        # its version first, and this replica then loads that version.
        await asyncio.to_thread(self._lock.acquire)
        try:
            if self.version is None or service.weight_source is not self:
                return  # another scheme (or set_weight_version) produced the live weights
            handle = service.replica_handle(rid)
            if self.transport == "storage":
                await handle.collective_rpc.remote(
                    "load_weights_from_storage", (str(self._writer.root), self.version)
                )
            else:
                header_json, buffers = self._last_update
                group = await asyncio.to_thread(self._form_group, [handle])
                ref = handle.collective_rpc.remote("receive_weight_broadcast", (header_json,))
                await asyncio.to_thread(group.send, buffers)
                await ref
                await handle.collective_rpc.remote("close_weight_broadcast")
                group.close()
            await handle.set_weight_version.remote(self.version)
            logger.info("restarted replica %d brought to weight version %s", rid, self.version)
        finally:
            self._lock.release()

    def close(self) -> None:
        """Leave the broadcast group and stop bringing restarted replicas up to date."""
        if self.service.weight_source is self:
            logger.warning(
                "closing the weight-sync scheme whose version %s is live: a replica restarted "
                "from now on serves the checkpoint's weights until the next push",
                self.version,
            )
        self.service.remove_restart_hook(self._bring_up_to_date)
        self._drop_group()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> WeightSyncScheme:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
