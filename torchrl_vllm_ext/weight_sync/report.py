"""SyncReport: what one push did and how long it took (``WeightSyncScheme.push`` returns it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SyncReport:
    """What one push did and how long it took."""

    version: str
    """The version now served by every replica."""
    transport: str
    """``storage``, ``broadcast``, ``ipc``, or the routes of a planned push joined
    (``ipc+nccl``)."""
    nbytes: int
    """Bytes of weights pushed."""
    seconds: float
    """From ``push`` to every replica serving the new version."""
    pause_s: dict[int, float] = field(default_factory=dict)
    """Per replica: how long generation was paused, as the replica's actor measures it
    (from sending the pause-and-load call to the answer of the label-and-resume call:
    the engine's own pause lies within it)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase. Storage: validate, write (copy, finiteness and checksums in one
    pass), stage (replicas checksum the slot), apply (pause, load, resume), load (the
    slowest replica's pause-and-load call, from its send to its answer). Broadcast:
    validate, pack, cut (per-worker sends: each worker's slices cut from the buckets),
    send (workers receive and verify while generating), apply, load. Both, on a verified push:
    reference (the trainer's probe log-probs, beside prepare), verify (every replica's
    probe, after its pause). A sharded push: its ranks' steps first (agree, reference:
    their collective forward, ranks_write: storage), then the scheme's (publish or send,
    stage, apply, ...)."""
    probe_gap: dict[int, float] = field(default_factory=dict)
    """Per replica: mean |replica - trainer (float32)| log-prob over the probe (empty: not
    verified)."""
    staged_in: dict[int, str] = field(default_factory=dict)
    """GPU replicas: where each staged the version before its pause (``device``,
    ``pinned`` host memory when its GPU lacked room, or ``mapped``: not copied, the pause
    read the storage slot, when a pinned copy per worker would not fit the host)."""
    probe_deferred: list[int] = field(default_factory=list)
    """Replicas loaded while paused or with their KV cache asleep: their value check runs
    when the service serves again (``resume`` / ``wake_up``), which raises if it fails."""
    probe_limit: float | None = None
    """The largest ``probe_gap`` this push allowed (None: not verified): ``verify_tol``, or
    ``max(1e-3, 3 x probe_noise)`` (:attr:`~torchrl_vllm_ext.weight_sync.verify.Reference.limit`)."""
    probe_noise: float | None = None
    """Mean |served dtype - float32| log-prob over the probe, both computed by the trainer
    with the pushed weights (0 for float32 replicas; None: not verified)."""
    loads: dict[int, list[dict]] = field(default_factory=dict)
    """Per replica, per worker: how it loaded (``path``: ``replay`` of its load plan,
    ``scatter`` of a delta's changed values through it, ``trace`` on the first push of a
    layout, ``loader``, or ``layerwise`` for MoE / quantized / CPU-packed models;
    ``nbytes`` (pushed), ``received_bytes`` (what it read: a storage worker reads its
    slices; None: every byte), ``kept_bytes`` (its slices: :attr:`kept_share`),
    ``sliced_received_bytes`` / ``sliced_kept_bytes`` and ``whole`` (the tensors it read
    whole, with the reason: :attr:`reads`), ``replayed_bytes`` (a scatter's: the bytes it
    wrote), ``why``: :class:`~torchrl_vllm_ext.weight_sync.loading.planned.LoadReport`)."""

    sent_bytes: int = 0
    """Bytes the transport moved: the full push's (cast to the served dtype with delta
    pushes on), a delta's changed values and positions, or per-worker sends' payloads
    summed over the workers."""
    base: str | None = None
    """The version a delta push changed, which every replica it reached held; None: a
    full push."""
    sends: str | None = None
    """How a broadcast push reached the workers: ``per-worker`` (each worker of a
    tensor-parallel replica sent only the slices its load plan keeps: :attr:`reads`) or
    ``broadcast`` (every byte to every worker); None: another transport."""
    sends_why: str | None = None
    """Why that way (``one worker per replica keeps every byte``, ``worker 1 of replica
    0 has no load plan of this layout to replay ...``)."""

    @property
    def sent_share(self) -> float:
        """``sent_bytes`` over ``nbytes`` (1.0: every byte as pushed; 0.5: a bf16 full push
        of float32 weights)."""
        return self.sent_bytes / self.nbytes if self.nbytes else 0.0

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def replayed_bytes(self) -> int:
        """Bytes every replica's workers loaded by their plan's replay (one batched copy),
        summed over replicas and workers."""
        return sum(w.get("replayed_bytes", 0) for ws in self.loads.values() for w in ws)

    @property
    def kept_share(self) -> float | None:
        """What the workers keep of the pushed bytes, summed over every worker whose
        load plan says (1.0: every worker keeps every byte; a tensor-parallel replica's
        workers keep about 1 / TP of the sharded tensors); None: none says."""
        reported = [w for ws in self.loads.values() for w in ws if w.get("kept_bytes") is not None]
        received = sum(w["nbytes"] for w in reported)
        return sum(w["kept_bytes"] for w in reported) / received if received else None

    @property
    def reads(self) -> dict[int, list[WorkerReads]]:
        """Per replica, per worker: the bytes it received against those it keeps."""
        return {rid: [WorkerReads.of(w) for w in ws] for rid, ws in self.loads.items()}

    @property
    def replayed_share(self) -> float | None:
        """The share of the loaded bytes that replayed (None: no worker reported)."""
        total = sum(w.get("nbytes", 0) for ws in self.loads.values() for w in ws)
        return self.replayed_bytes / total if total else None


@dataclass(frozen=True)
class WorkerReads:
    """What one worker received of a push against what it keeps (a storage worker reads
    only its slices of the tensors its load plan cuts).

    Examples:
        >>> w = WorkerReads.of({"nbytes": 100, "received_bytes": 60, "kept_bytes": 60,
        ...                     "sliced_received_bytes": 40, "sliced_kept_bytes": 40,
        ...                     "whole": {"norm": "replicated"}})
        >>> w.received_share, w.sliced_ratio, w.whole
        (0.6, 1.0, {'norm': 'replicated'})
    """

    nbytes: int
    """Bytes pushed."""
    received: int
    """Bytes it read (every byte, where the transport hands it every tensor whole)."""
    kept: int | None
    """Bytes it keeps (its load plan's slices); None: no plan says."""
    sliced_received: int | None
    """Of ``received``, the bytes of the tensors it read as slices (None: none)."""
    sliced_kept: int | None
    """Of ``kept``, those tensors' bytes."""
    whole: dict[str, str]
    """Tensors it read whole although it had a plan: name -> why."""

    @classmethod
    def of(cls, load: dict) -> WorkerReads:
        """From one worker's entry of :attr:`SyncReport.loads`."""
        received = load.get("received_bytes")
        return cls(
            load["nbytes"],
            load["nbytes"] if received is None else received,
            load.get("kept_bytes"),
            load.get("sliced_received_bytes"),
            load.get("sliced_kept_bytes"),
            dict(load.get("whole") or {}),
        )

    @property
    def received_share(self) -> float:
        """``received`` over the bytes pushed (1.0: every tensor whole)."""
        return self.received / self.nbytes if self.nbytes else 0.0

    @property
    def received_over_kept(self) -> float | None:
        """``received`` over ``kept`` (1.0: it received only what it keeps)."""
        return self.received / self.kept if self.kept else None

    @property
    def sliced_ratio(self) -> float | None:
        """Bytes received over bytes kept of the tensors read as slices (1.0: exactly its
        share; None: none read as slices)."""
        if not self.sliced_kept:
            return None
        return self.sliced_received / self.sliced_kept
