"""The replica's two extensions, declared once: where they live and what they offer.

A replica hosts two extensions, both named by dotted path in
:class:`~torchrl_vllm_ext.engine.config.ServiceConfig` so that ``engine/`` never imports
``weight_sync/``:

- the **worker extension**, which vLLM mixes into every model worker
  (``worker_extension_cls``) and the replica calls through ``collective_rpc``: it
  receives, verifies and loads weights (:class:`WorkerMethods`);
- the **actor extension**, an object in the replica's Ray actor, called through
  ``VLLMReplica.extension_call``: work that must not hold up the engine's steps, such as
  checksumming a storage slot before the pause (:class:`ActorMethods`).

Every argument and result is plain data (str, bytes, int, float, bool). A transport names the
methods it calls from here; ``tests/unit/test_protocol.py`` checks that each one exists
with these parameters.
"""

from __future__ import annotations

WORKER_EXTENSION = "torchrl_vllm_ext.weight_sync.worker.WeightSyncWorkerExtension"
"""vLLM ``worker_extension_cls`` of every replica: every transport's receiver."""
ACTOR_EXTENSION = "torchrl_vllm_ext.weight_sync.actor.WeightSyncActorExtension"
"""Actor extension of every replica: storage staging in the actor."""
ENGINE_UPDATES = "torchrl_vllm_ext.weight_sync.torchrl.engine_updates.EngineUpdates"
"""What the service's TorchRL engine weight calls (``RLvLLMEngine.update_weights``, ...)
go through: built with the service on first use (``EngineUpdates(service)``)."""


def load_class(path: str) -> type:
    """The class a dotted path names (the extensions and engine updates above)."""
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class WorkerMethods:
    """Worker-extension methods, ``name  # (arguments) -> result`` (one result per worker)."""

    LOAD_FROM_STORAGE = "load_weights_from_storage"
    """(path: str, version: str | None = None, verified: bool = False) -> loaded version."""
    INIT_BROADCAST = "init_weight_broadcast"
    """(host, port, world_size, rank_offset, backend, timeout_s) -> this worker's rank."""
    STAGE_BROADCAST = "stage_weight_broadcast"
    """(header_json: str) -> True; receives and verifies in a background thread."""
    STAGED_READY = "staged_weights_ready"
    """(version: str) -> whether the staged receive finished (raises if it failed)."""
    BROADCAST_SLICES = "weight_broadcast_slices"
    """(header_json: str) -> {tensor name: [[start, stop], ...]} | None; the element runs
    the worker keeps of each tensor of the header (its load plan's), None: no plan."""
    STAGE_SENDS = "stage_weight_sends"
    """(update_json: str) -> True; receives only this worker's slices, point to point, and
    verifies them in a background thread (then ``apply_staged_weights``)."""
    RECEIVE_BROADCAST = "receive_weight_broadcast"
    """(header_json: str) -> loaded version; receive, verify, load (restarted replicas)."""
    CLOSE_BROADCAST = "close_weight_broadcast"
    """() -> whether a group was open."""
    RELEASE_STORAGE = "release_weight_storage"
    """(path: str) -> whether it was mapped; drops this worker's mappings of a storage root."""
    STAGE_FROM_STORAGE = "stage_weights_from_storage"
    """(path: str, version: str) -> "device" | "pinned" | "mapped"; GPU workers copy the
    published slot to their staging buffers in a background thread (then
    ``apply_staged_weights``)."""
    DEVICE = "weight_sync_device"
    """() -> the normalised UUID of the worker's GPU, or None (the transport plan)."""
    STAGE_IPC = "stage_weight_ipc"
    """(update_json: str) -> True; opens the trainer's buckets by CUDA IPC and checksums
    them on the GPU in a background thread (then ``apply_staged_weights``)."""
    RECEIVE_IPC = "receive_weight_ipc"
    """(update_json: str) -> loaded version; open, verify, load (restarted replicas)."""
    WEIGHTS_INTACT = "weights_intact"
    """() -> False after a load that failed once it had begun writing the parameters."""
    FORGET_SERVED = "forget_served_weights"
    """() -> True; vLLM's level-2 sleep discarded the parameters: the next delta push is
    loaded whole, not scattered into them."""
    RELEASE_IPC = "release_weight_ipc"
    """() -> whether it held any; drops this worker's mappings of the trainer's CUDA IPC
    buckets (kept from push to push while the trainer re-packs them in place)."""
    APPLY_STORAGE = "apply_weights_from_storage"
    """(path: str, version: str) -> {"version", "path", "nbytes", "replayed_bytes", "why"};
    the CPU storage pause call: load the published slot (checksummed by the actor) and
    say how (the load plan's replay, its trace, the loader, or vLLM's layerwise reload)."""
    APPLY_STAGED = "apply_staged_weights"
    """(version: str) -> the same report; the staged transports' pause call."""
    ADD_LORA_TENSORS = "add_lora_from_tensors"
    """(lora_id: int, name: str, header_json: str, data: bytes-like) -> True; builds a LoRA
    adapter from its tensors (``engine.adapters.AdapterTensors``: no file) and registers
    it, pinned, with the worker's LoRA manager (the replica's ``add_lora_tensors``)."""


OWN_WORKER_METHODS = frozenset(v for k, v in vars(WorkerMethods).items() if k.isupper())
"""Every worker method of ours: a worker call outside it may write the served weights."""


class ActorMethods:
    """Actor-extension methods, called with ``VLLMReplica.extension_call(name, args)``."""

    STAGE_STORAGE = "stage_storage"
    """(root: str, version: str) -> version; checksums the published slot."""
    RELEASE_STORAGE = "release_storage"
    """(root: str) -> whether it was mapped; drops the actor's mappings of a storage root."""


PACKED_WEIGHTS_ENV = "TORCHRL_VLLM_CPU_PACKED_WEIGHTS"
"""How ``ServiceConfig.cpu_packed_weights`` reaches the worker extension: set ("1" / "0")
in each replica's environment, read by the worker before its model loads."""

LOAD_PLAN_ENV = "TORCHRL_VLLM_LOAD_PLAN"
"""``0`` in the driver's environment when replicas start (every ``TORCHRL_VLLM_*`` setting
reaches them): every in-place load runs the model's loader, no load plan."""

SETTINGS_PREFIX = "TORCHRL_VLLM_"
"""The package's settings in the driver's environment: each reaches the replicas."""
