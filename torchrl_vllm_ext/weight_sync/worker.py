"""vLLM worker extension: the receiving end of both transports.

vLLM mixes this class into every model worker (``worker_extension_cls``); the
replica actor calls its methods through ``collective_rpc``. Their names and arguments
are declared in :class:`torchrl_vllm_ext.protocol.WorkerMethods`; arguments and results
are plain data (strings, ints). Every method verifies what it received before it
touches the served weights, and loads through the model's own ``load_weights``,
which maps Hugging Face names onto vLLM's fused and sharded parameters.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

import torch

from torchrl_vllm_ext._compat import worker_reload_weights
from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.protocol import TEST_FAIL_HALF_WAY, TEST_SKIP_LOAD_ENV
from torchrl_vllm_ext.weight_sync import cpu_layout
from torchrl_vllm_ext.weight_sync.collective import make_process_group
from torchrl_vllm_ext.weight_sync.ipc import device_uuid, open_bucket
from torchrl_vllm_ext.weight_sync.packing import unpack
from torchrl_vllm_ext.weight_sync.params import device_checksum
from torchrl_vllm_ext.weight_sync.slots import SlotReader
from torchrl_vllm_ext.weight_sync.specs import IpcUpdate, UpdateHeader, from_json
from torchrl_vllm_ext.weight_sync.staging import staging_place

logger = logging.getLogger(__name__)

# Only vLLM worker processes import this module (as ``worker_extension_cls``), before
# they build the model: on CPU the weights then stay updatable in place.
cpu_layout.keep_checkpoint_layout()


class WeightSyncWorkerExtension:
    """Methods vLLM adds to its model worker (``self`` is the vLLM ``Worker``)."""

    # ------------------------------------------------------------------ storage
    def load_weights_from_storage(
        self, path: str, version: str | None = None, verified: bool = False
    ) -> str:
        """Read, verify and load the published slot of ``path``; returns the loaded version.

        ``verified=True`` skips the checksums: the replica actor on this host verified
        ``version`` just before the pause (``WeightSyncActorExtension.stage_storage``).
        """
        manifest, tensors = self._tvllm_reader(path).read(version, verify=not verified)
        self._tvllm_load(tensors.items(), manifest.version)
        return manifest.version

    def stage_weights_from_storage(self, path: str, version: str) -> str:
        """GPU workers: copy the published slot of ``path`` (checksummed by the replica
        actor) to this worker's GPU, or to pinned host memory when the GPU lacks room, in a
        background thread while the engine keeps generating; ``load_staged_weights``
        then copies it into the parameters in the pause. Returns where it stages."""
        manifest, tensors = self._tvllm_reader(path).read(version, verify=False)
        device = torch.device("cuda", torch.cuda.current_device())
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        held = self.__dict__.get("_tvllm_stage_buffers", {})
        held_bytes = sum(b.numel() * b.element_size() for b in held.values())
        free, total = torch.cuda.mem_get_info(device)
        place = staging_place(nbytes, free, total, held_bytes)
        self._tvllm_stage(manifest.version, lambda: self._tvllm_copy_in(tensors, device, place))
        return place

    def _tvllm_copy_in(self, tensors, device, place: str) -> list[tuple[str, torch.Tensor]]:
        """Copy ``tensors`` into this worker's staging buffers (kept from push to push: the
        memory is taken once), on a side stream so the engine's own work is not ordered
        behind it."""
        buffers = self.__dict__.setdefault("_tvllm_stage_buffers", {})
        stream = torch.cuda.Stream(device) if place == "device" else None
        out = []
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for name, src in tensors.items():
                buf = buffers.get(name)
                on = device if place == "device" else torch.device("cpu")
                if (
                    buf is None
                    or buf.shape != src.shape
                    or buf.dtype != src.dtype
                    or buf.device != on
                ):
                    buf = torch.empty(
                        src.shape, dtype=src.dtype, device=on, pin_memory=place == "pinned"
                    )
                    buffers[name] = buf
                buf.copy_(src)
                out.append((name, buf))
        if stream is not None:
            stream.synchronize()
        return out

    def release_weight_storage(self, path: str) -> bool:
        """Drop this worker's mappings of ``path`` (its scheme closed: the memory of the
        removed slots is freed once nobody maps them). The loaded weights are copies."""
        reader = self.__dict__.get("_tvllm_readers", {}).pop(path, None)
        if reader is not None:
            reader.close()
        return reader is not None

    def _tvllm_stage(self, version: str, produce) -> bool:
        """Run ``produce() -> [(name, tensor)]`` in a thread while the engine keeps generating."""
        staged: dict = {}

        def run():
            try:
                staged["result"] = produce()
            except BaseException as e:  # reported by staged_weights_ready / load_staged_weights
                staged["error"] = e

        thread = threading.Thread(target=run, name="tvllm-stage", daemon=True)
        thread.start()
        self._tvllm_staged = (version, thread, staged)
        return True

    def staged_weights_ready(self, version: str) -> bool:
        """Whether the staged read of ``version`` finished; raises if it failed (bad slot)."""
        thread, staged = self._tvllm_staged_for(version)
        if thread.is_alive():
            return False
        if "error" in staged:
            self._tvllm_staged = (None, None, {})
            raise staged["error"]
        return True

    def load_staged_weights(self, version: str) -> str:
        """Finish the staged read and load it (the only part that needs the pause)."""
        thread, staged = self._tvllm_staged_for(version)
        thread.join()
        self._tvllm_staged = (None, None, {})
        if "error" in staged:
            raise staged["error"]
        self._tvllm_load(staged["result"], version)
        if (
            self.__dict__.get("_tvllm_stage_buffers")
            and self.vllm_config.model_config.enable_sleep_mode
        ):
            # A replica that sleeps gives its GPU to a colocated trainer: staging buffers
            # kept from push to push would stay allocated through its sleep.
            del self._tvllm_stage_buffers
            torch.cuda.empty_cache()
        return version

    def _tvllm_staged_for(self, version: str):
        staged_version, thread, staged = getattr(self, "_tvllm_staged", (None, None, {}))
        if staged_version != version or thread is None:
            raise WeightSyncError(
                f"no staged weights for version {version!r}; call stage_weight_broadcast first."
            )
        return thread, staged

    def _tvllm_reader(self, path: str) -> SlotReader:
        readers = self.__dict__.setdefault("_tvllm_readers", {})
        if path not in readers:
            readers[path] = SlotReader(path)
        return readers[path]

    # ------------------------------------------------------------------ broadcast
    def init_weight_broadcast(
        self,
        host: str,
        port: int,
        world_size: int,
        rank_offset: int,
        backend: str,
        timeout_s: float,
    ) -> int:
        """Join the trainer's broadcast group; returns this worker's rank in it."""
        self.close_weight_broadcast()
        rank = rank_offset + self.rank
        self._tvllm_group = make_process_group(backend, host, port, world_size, rank, timeout_s)
        self._tvllm_device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        return rank

    def receive_weight_broadcast(self, header_json: str) -> str:
        """Receive every bucket of one update, verify all, then load; returns the version."""
        header = from_json(header_json, UpdateHeader)
        self._tvllm_load(self._tvllm_receive(header), header.version)
        return header.version

    def stage_weight_broadcast(self, header_json: str) -> bool:
        """Receive and verify one update in a background thread (before the pause)."""
        header = from_json(header_json, UpdateHeader)
        return self._tvllm_stage(header.version, lambda: self._tvllm_receive(header))

    def _tvllm_receive(self, header: UpdateHeader) -> list[tuple[str, torch.Tensor]]:
        group = getattr(self, "_tvllm_group", None)
        if group is None:
            raise WeightSyncError(
                "this worker is not in a broadcast group; call init_weight_broadcast first."
            )
        received = []
        for bucket in header.buckets:
            buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self._tvllm_device)
            try:
                group[1].broadcast(buf, 0).wait()
            except Exception as e:  # the trainer died or stalled past the group's timeout
                # The group is unusable now; the next push forms a new one.
                if getattr(self, "_tvllm_group", None) is group:
                    self._tvllm_group = None
                error = WeightSyncError(
                    f"broadcast of weight version {header.version} was cut off after "
                    f"{len(received)} of {len(header.buckets)} buckets ({type(e).__name__}: "
                    f"{e}); nothing was loaded, this worker keeps serving its previous weights. "
                    "Push again: the next push forms a new group."
                )
                logger.error("%s", error)
                raise error from e
            received.append((bucket, buf))
        for i, (bucket, buf) in enumerate(received):
            got = device_checksum(buf)  # on the GPU for NCCL: no copy to the host
            if got != bucket.checksum:
                raise WeightSyncError(
                    f"bucket {i} of version {header.version} arrived corrupted (checksum {got} != "
                    f"{bucket.checksum}); nothing was loaded."
                )
        # Loaded in one reload: vLLM re-processes a layer once all its weights arrived.
        return [item for bucket, buf in received for item in unpack(bucket, buf)]

    def close_weight_broadcast(self) -> bool:
        group = getattr(self, "_tvllm_group", None)
        self._tvllm_group = None
        return group is not None

    # ------------------------------------------------------------------ CUDA IPC
    def weight_sync_device(self) -> str | None:
        """The normalised UUID of this worker's GPU (None without CUDA): the transport plan
        compares devices by UUID, since Ray renumbers the GPUs each process sees."""
        if not torch.cuda.is_available():
            return None
        return device_uuid(torch.cuda.current_device())

    def stage_weight_ipc(self, update_json: str) -> bool:
        """Open the trainer's buckets on this GPU (CUDA IPC, no copy) and checksum them on
        the GPU, in a background thread; the pause then copies them into the parameters."""
        update = from_json(update_json, IpcUpdate)
        return self._tvllm_stage(update.header.version, lambda: self._tvllm_open_ipc(update))

    def receive_weight_ipc(self, update_json: str) -> str:
        """Open, verify and load one CUDA IPC update (a restarted replica); its version."""
        update = from_json(update_json, IpcUpdate)
        self._tvllm_load(self._tvllm_open_ipc(update), update.header.version)
        return update.header.version

    def _tvllm_open_ipc(self, update: IpcUpdate) -> list[tuple[str, torch.Tensor]]:
        out = []
        for i, (bucket, handle) in enumerate(
            zip(update.header.buckets, update.handles, strict=True)
        ):
            buf = open_bucket(handle)
            got = device_checksum(buf)
            if got != bucket.checksum:
                raise WeightSyncError(
                    f"bucket {i} of version {update.header.version} read through CUDA IPC does "
                    f"not match the trainer's (checksum {got} != {bucket.checksum}); nothing "
                    "was loaded."
                )
            out.extend(unpack(bucket, buf))
        return out

    # ------------------------------------------------------------------ shared
    def _tvllm_load(self, named_tensors, version: str) -> None:
        named_tensors, fail = _skip_for_test(named_tensors, version)
        model = self.get_model()
        # Set until the load completes: one that fails from here on may have written some
        # parameters, and the replica must not serve them (weights_intact says so).
        self._tvllm_writing = version
        if cpu_layout.loads_in_place(model):
            # The model's own loader maps HF names onto fused/sharded parameters and
            # copies into them: the served tensors stay where they are.
            model.load_weights(iter(named_tensors))
        else:
            # Packed (CPU oneDNN), expert (MoE) or quantized weights: vLLM's layerwise
            # reload redoes the post-load processing of every layer (and _compat what it
            # misses).
            worker_reload_weights(self, named_tensors)
        if fail:
            raise RuntimeError(f"test hook: load of {version} failed half-way")
        self._tvllm_writing = None

    def weights_intact(self) -> bool:
        """False after a load that failed once it had begun writing the parameters."""
        return getattr(self, "_tvllm_writing", None) is None


def _skip_for_test(named_tensors, version: str):
    """``(tensors, fail)``: the tensors a test leaves out of ``version`` left out, or half of
    them with ``fail`` set (:data:`TEST_SKIP_LOAD_ENV`)."""
    skip = skipped_for_test(os.environ.get(TEST_SKIP_LOAD_ENV, ""), version)
    if not skip:
        return named_tensors, False
    logger.warning(
        "test hook %s: not loading %s of version %s", TEST_SKIP_LOAD_ENV, sorted(skip), version
    )
    if TEST_FAIL_HALF_WAY in skip:
        named_tensors = list(named_tensors)
        return named_tensors[: len(named_tensors) // 2], True
    return [(n, t) for n, t in named_tensors if n not in skip], False


def skipped_for_test(knob: str, version: str) -> set[str]:
    """The tensors ``knob`` (``"<version>=<tensor>[,<version>=<tensor>...]"``) names for
    ``version``: one replica start serves many broken pushes.

    Examples:
        >>> sorted(skipped_for_test("v1=a.w,v2=b.w,v1=c.w", "v1"))
        ['a.w', 'c.w']
    """
    entries = (entry.partition("=") for entry in knob.split(",") if entry)
    return {name for v, _, name in entries if v == version}
