"""vLLM worker extension: the receiving end of every weight-sync transport.

vLLM mixes ``worker_extension_cls`` (:data:`torchrl_vllm_ext.extensions.WORKER_EXTENSION`, a
stable dotted path) into every model worker by inheritance; the replica actor calls its
methods through ``collective_rpc``. Every method is a one-line delegation to the one object
the worker holds, :class:`WorkerWeightSync` (built at the first call: the shared staging and
loading step, :class:`~.loading.loads.Loads`, and each transport's receiver over it), so no
state of ours is spread over vLLM's ``Worker``. Method names and arguments are declared in
:class:`torchrl_vllm_ext.extensions.WorkerMethods`; arguments and results are plain data.
Every method verifies what it received before it touches the served weights.
"""

from __future__ import annotations

from torchrl_vllm_ext import leftovers
from torchrl_vllm_ext.weight_sync import cpu_layout
from torchrl_vllm_ext.weight_sync.adapter_receiver import AdapterReceiver
from torchrl_vllm_ext.weight_sync.loading.loads import Loads
from torchrl_vllm_ext.weight_sync.transports.auto.receiver import PlanReceiver
from torchrl_vllm_ext.weight_sync.transports.broadcast.receiver import BroadcastReceiver
from torchrl_vllm_ext.weight_sync.transports.ipc.receiver import IpcReceiver
from torchrl_vllm_ext.weight_sync.transports.storage.receiver import StorageReceiver

# Only vLLM worker processes import this module (as ``worker_extension_cls``), before
# they build the model: on CPU the weights then stay updatable in place.
cpu_layout.keep_checkpoint_layout()
# ...and before vLLM's weight-loading bars take tqdm's lock: a thread lock, not a named
# semaphore that a killed engine-core process would leave in /dev/shm.
leftovers.thread_only_progress_lock()

_ATTRIBUTE = "_tvllm_weight_sync"
"""The one attribute of ours on vLLM's ``Worker``: its :class:`WorkerWeightSync`."""


class WorkerWeightSync:
    """Everything weight sync keeps in one vLLM worker, built once with typed fields.

    Args:
        worker: vLLM's ``Worker`` (its model, config and layerwise reload).
        loads_class: the staging and loading step (a test's subclass breaks loads on
            purpose: ``torchrl_vllm_ext.testing.worker``).
    """

    def __init__(self, worker, loads_class: type[Loads] = Loads):
        self.loads = loads_class(worker)
        """Staging buffer, load plans, the staged version and the writing flag."""
        self.storage = StorageReceiver(self.loads)
        self.broadcast = BroadcastReceiver(self.loads)
        self.ipc = IpcReceiver(self.loads)
        self.plan = PlanReceiver()
        self.adapters = AdapterReceiver(worker)
        """LoRA adapters from memory (not weight versions: no load, no pause)."""

    @classmethod
    def of(cls, worker) -> WorkerWeightSync:
        """The worker's object, built at the first call (vLLM builds the worker, not us)."""
        state = worker.__dict__.get(_ATTRIBUTE)
        if state is None:
            state = worker.__dict__[_ATTRIBUTE] = cls(worker, worker.loads_class)
        return state


def _of(worker) -> WorkerWeightSync:
    return WorkerWeightSync.of(worker)


class WeightSyncWorkerExtension:
    """Methods vLLM adds to its model worker (``self`` is vLLM's ``Worker``)."""

    loads_class: type[Loads] = Loads
    """The staging and loading step each worker builds (tests name a subclass)."""

    # the shared step (every staged transport)
    def staged_weights_ready(self, version: str) -> bool:
        """Whether the staged read of ``version`` finished; raises if it failed."""
        return _of(self).loads.staged_ready(version)

    def apply_staged_weights(self, version: str) -> dict:
        """The staged transports' pause call: load ``version``; ``{"version", "path",
        "nbytes", "replayed_bytes", "why"}``."""
        return {"version": version, **_of(self).loads.load_staged(version).as_dict()}

    def weights_intact(self) -> bool:
        """False after a load that failed once it had begun writing the parameters."""
        return _of(self).loads.intact()

    def forget_served_weights(self) -> bool:
        """vLLM's level-2 sleep discarded the parameters: load the next delta whole."""
        return _of(self).loads.forget_served()

    # storage
    def load_weights_from_storage(
        self, path: str, version: str | None = None, verified: bool = False
    ) -> str:
        """Read, verify and load the published slot of ``path``; the loaded version."""
        return _of(self).storage.load_weights_from_storage(path, version, verified)

    def apply_weights_from_storage(self, path: str, version: str) -> dict:
        """The CPU storage pause call: load slot ``version`` of ``path``; how it loaded."""
        return _of(self).storage.apply_weights_from_storage(path, version)

    def stage_weights_from_storage(self, path: str, version: str) -> str:
        """GPU workers: stage slot ``version`` of ``path``; where it stages."""
        return _of(self).storage.stage_weights_from_storage(path, version)

    def release_weight_storage(self, path: str) -> bool:
        """Drop this worker's mappings of ``path``; whether it mapped it."""
        return _of(self).storage.release_weight_storage(path)

    # broadcast
    def init_weight_broadcast(
        self,
        host: str,
        port: int,
        world_size: int,
        rank_offset: int,
        backend: str,
        timeout_s: float,
    ) -> int:
        """Join the trainer's broadcast group; this worker's rank in it."""
        return _of(self).broadcast.init_weight_broadcast(
            host, port, world_size, rank_offset, backend, timeout_s
        )

    def stage_weight_broadcast(self, header_json: str) -> bool:
        """Receive and verify one update in a background thread (before the pause)."""
        return _of(self).broadcast.stage_weight_broadcast(header_json)

    def weight_broadcast_slices(self, header_json: str) -> dict | None:
        """The element runs this worker keeps of each tensor of the header (None: no plan)."""
        return _of(self).broadcast.weight_broadcast_slices(header_json)

    def stage_weight_sends(self, update_json: str) -> bool:
        """Receive and verify only this worker's slices, in a background thread."""
        return _of(self).broadcast.stage_weight_sends(update_json)

    def receive_weight_broadcast(self, header_json: str) -> str:
        """Receive, verify and load one update (a restarted replica); its version."""
        return _of(self).broadcast.receive_weight_broadcast(header_json)

    def close_weight_broadcast(self) -> bool:
        """Leave the broadcast group; whether this worker was in one."""
        return _of(self).broadcast.close_weight_broadcast()

    # ipc
    def stage_weight_ipc(self, update_json: str) -> bool:
        """Open the trainer's buckets by CUDA IPC and checksum them, in a background thread."""
        return _of(self).ipc.stage_weight_ipc(update_json)

    def receive_weight_ipc(self, update_json: str) -> str:
        """Open, verify and load one CUDA IPC update (a restarted replica); its version."""
        return _of(self).ipc.receive_weight_ipc(update_json)

    def release_weight_ipc(self) -> bool:
        """Drop this worker's mappings of the trainer's buckets; whether it held any."""
        return _of(self).ipc.release_weight_ipc()

    # auto
    def weight_sync_device(self) -> str | None:
        """The normalised UUID of this worker's GPU, or None (the transport plan)."""
        return _of(self).plan.weight_sync_device()

    # LoRA adapters from memory
    def add_lora_from_tensors(
        self, lora_id: int, name: str, header_json: str, data: bytes | memoryview
    ) -> bool:
        """Build LoRA adapter ``lora_id`` from its tensors (no file) and register it; True."""
        return _of(self).adapters.add_lora_from_tensors(lora_id, name, header_json, data)
