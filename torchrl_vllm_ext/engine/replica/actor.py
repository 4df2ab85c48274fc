"""The replica: a Ray actor that hosts one vLLM v1 engine behind :class:`~.engine.Engine`.

One actor call generates a whole batch (the prompts run concurrently inside the
engine); results come back as one :class:`~torchrl_vllm_ext.batches.RequestBatch`.
Weight updates are one generic sequence (:meth:`VLLMReplica.update_weights`, done by its
:class:`~.worker_calls.WorkerCalls`) around a worker-extension method that the caller
names; the replica knows no transport. The actor holds its parts and its Ray methods
delegate to them (Ray calls methods of the actor's class): the weights it serves
(:class:`~.served_weights.ServedWeights`), its calls into its workers
(:class:`~.worker_calls.WorkerCalls`) and TorchRL's actor calls
(:class:`~.torchrl_calls.TorchRLActorCalls`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from torchrl_vllm_ext import leftovers
from torchrl_vllm_ext._compat import (
    PauseMode,
    engine_dead_errors,
    lora_request,
    release_distributed,
    vllm_engine_api,
    vllm_validation_errors,
)
from torchrl_vllm_ext.batches import PromptBatch, RequestBatch
from torchrl_vllm_ext.engine.adapters import Adapter, AdapterTensors, stage_files
from torchrl_vllm_ext.engine.outputs import pack_outputs
from torchrl_vllm_ext.engine.replica.adapter_use import AdapterUse
from torchrl_vllm_ext.engine.replica.engine import Engine
from torchrl_vllm_ext.engine.replica.kv_size import KvSizeLog
from torchrl_vllm_ext.engine.replica.served_weights import ServedWeights
from torchrl_vllm_ext.engine.replica.stderr_tail import (
    StderrMark,
    explain,
    redirect_output,
    root_cause,
)
from torchrl_vllm_ext.engine.replica.torchrl_calls import TorchRLActorCalls
from torchrl_vllm_ext.engine.replica.worker_calls import WorkerCalls
from torchrl_vllm_ext.engine.serving import ServingState
from torchrl_vllm_ext.engine.validation import make_sampling_params, with_seed
from torchrl_vllm_ext.errors import (
    GenerationTimeoutError,
    InvalidRequestError,
    ReplicaDeadError,
    ReplicaStartupError,
    WeightSyncError,
)
from torchrl_vllm_ext.extensions import WorkerMethods, load_class
from torchrl_vllm_ext.messages import ReplicaInfo, ReplicaStats

logger = logging.getLogger(__name__)

TEMP_PREFIX = leftovers.PREFIX + "replica-tmp-"
"""A replica process's temporary directory (:func:`~torchrl_vllm_ext.leftovers.adopt_tempdir`)."""

WATCH_GROUP = "start-watch"
"""The Ray concurrency group of :meth:`VLLMReplica.kv_cache_size`: its own thread and event
loop, so it answers while the engine's start blocks the actor's loop (``AsyncLLM`` is built
synchronously)."""
CONCURRENCY_GROUPS = {WATCH_GROUP: 1}
"""The replica actor class's concurrency groups (``ray.remote(concurrency_groups=...)``)."""


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything a replica actor is built from (plain data: it crosses to the actor)."""

    replica_id: int
    """Stable id of the replica within its service."""
    model: str
    """Local model path."""
    engine_kwargs: dict
    """Keyword arguments of vLLM's ``AsyncEngineArgs``."""
    weight_version: str = "0"
    """Version label the engine starts with."""
    env: dict[str, str | None] = field(default_factory=dict)
    """Environment of the engine's processes (None: unset), which inherit the actor's; see
    :func:`torchrl_vllm_ext.engine.driver.cluster.process_env`."""
    in_process: bool = False
    """Run vLLM's ``LLMEngine`` in the actor instead of ``AsyncLLM`` and its engine-core
    process (see :mod:`torchrl_vllm_ext.engine.replica.engine`)."""
    actor_extension: str | None = None
    """Dotted path of a class instantiated in the actor, whose public methods
    :meth:`VLLMReplica.extension_call` runs (see :mod:`torchrl_vllm_ext.extensions`)."""
    log_file: str | None = None
    """Append the actor's output (and its children's) to this file."""
    engine_cls: str | None = None
    """Dotted path of the :class:`Engine` to drive instead of vLLM's (a stand-in)."""


class VLLMReplica:
    """Ray actor body: one vLLM engine (the pool wraps it with ``ray.remote``).

    Args:
        spec: what to build (:class:`ReplicaSpec`).
    """

    def __init__(self, spec: ReplicaSpec):
        if spec.log_file is not None:
            redirect_output(spec.log_file)
        for key, value in spec.env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self.replica_id = spec.replica_id
        self._model = spec.model
        self._engine_kwargs = dict(spec.engine_kwargs)
        self._weights = ServedWeights(spec.replica_id, spec.weight_version)
        self._outstanding = 0
        # The service's pause and vLLM's sleep: a push pauses and resumes only a replica
        # that serves, and is refused while the weights sleep (engine/serving.py).
        self._state = ServingState()
        self._inflight: set[str] = set()  # in-flight request ids
        self._engine_class = (
            load_class(spec.engine_cls) if spec.engine_cls else engine_class(spec.in_process)
        )
        kwargs = self._engine_kwargs
        self._workers = WorkerCalls(
            self.replica_id,
            self._require_engine,
            self._weights,
            lambda: self._state,
            self._inflight,
            load_class(spec.actor_extension)() if spec.actor_extension else None,
            worker_extension=bool(kwargs.get("worker_extension_cls")),
        )
        self._torchrl = TorchRLActorCalls(
            self.replica_id,
            self._require_engine,
            kwargs.get("tokenizer") or self._model,
            kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1),
            self._workers.collective_rpc,
            lambda: self._outstanding,
        )
        self._shipped: Path | None = None  # adapters shipped to this node (stage_files)
        self._memory_adapters = AdapterUse()  # adapters from memory, and their batches
        self._tmp: Path | None = None  # this process's TMPDIR (vLLM's rendezvous, sockets)
        # The KV-cache size the starting engine logs (read by kv_cache_size from another
        # thread).
        self._kv_log = KvSizeLog()
        self.engine: Engine | None = None

    def preload(self) -> None:
        """Import vLLM (seconds to tens of seconds) before the engine may start: a replica
        waiting for its GPU's KV-cache size does it meanwhile."""
        vllm_engine_api()

    async def start(
        self, kv_cache_memory_bytes: int | None = None, report_kv_size: bool = False
    ) -> ReplicaInfo:
        """Build the engine; return what the router and validators need to know.

        Args:
            kv_cache_memory_bytes: the KV-cache size to start with (replicas sharing a
                GPU: the size the first one measured; see
                :mod:`~torchrl_vllm_ext.engine.driver.start_order`); None: vLLM sizes it
                (or the engine arguments give it).
            report_kv_size: route the workers' KV-size log lines to a file of this replica,
                which :meth:`kv_cache_size` reads while the engine still starts.
        """
        self._kv_log.over = False
        try:
            return await self._start(kv_cache_memory_bytes, report_kv_size)
        finally:
            self._kv_log.over = True

    async def _start(self, kv_cache_memory_bytes: int | None, report_kv_size: bool) -> ReplicaInfo:
        # A replica killed on this node (SIGKILL: no cleanup) left its shipped adapters
        # and its temporary directory.
        await asyncio.to_thread(leftovers.reap)
        self._tmp = leftovers.adopt_tempdir(TEMP_PREFIX)
        kwargs = {"enable_log_requests": False, "disable_log_stats": True}
        kwargs.update(self._engine_kwargs)
        if kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
        api = vllm_engine_api()
        stderr_mark = StderrMark()  # an engine-core process's traceback lands past it
        try:
            args = api.AsyncEngineArgs(model=self._model, **kwargs)
            with self._kv_log.routed(self._tmp, report_kv_size):
                self.engine = await self._engine_class.start(args)
            await self.engine.set_weight_version(self._weights.version)
            # One token through the model before taking traffic, with the options every
            # request has (sampled-token log-probs): vLLM-CPU runs no forward pass while
            # it starts, so a kernel it lacks for this model (an unsupported head size,
            # say) would otherwise kill the replica in its first batch, and that batch
            # would also pay the first log-prob computation.
            await self.engine.generate(
                [{"prompt_token_ids": [0]}],
                [make_sampling_params({"max_tokens": 1})],
                [f"warm-up-{self.replica_id}-{os.getpid()}"],
            )
            # The engine's locks exist now: unlink their names (the locks keep working, and
            # nothing spawned later opens them by name), so a killed replica leaves none.
            leftovers.release_semaphores()
        except Exception as e:
            await asyncio.to_thread(self._release_failed_start)
            raise ReplicaStartupError(
                f"replica {self.replica_id} could not start vLLM on {self._model!r}: "
                f"{explain(root_cause(e), stderr_mark)} (engine arguments: {kwargs})"
            ) from e
        import ray

        limits = self.engine.limits
        logged = self._kv_log.size()
        info = ReplicaInfo(
            replica_id=self.replica_id,
            pid=os.getpid(),
            node_ip=ray.util.get_node_ip_address(),
            max_model_len=limits.max_model_len,
            max_token_id=limits.max_token_id,
            kv_capacity_tokens=limits.kv_capacity_tokens,
            temp_dir=str(self._tmp),
            dtype=limits.dtype,
            kv_cache_bytes=kwargs.get("kv_cache_memory_bytes") or logged,
        )
        logger.info("replica %d ready: %s", self.replica_id, info)
        return info

    async def kv_cache_size(self, poll_s: float = 0.25) -> int | None:
        """The KV-cache size (bytes) the engine being started logged, as soon as it does:
        after vLLM's memory profile, before CUDA-graph capture. None when the start ended
        without one (it was not started with ``report_kv_size``, vLLM's logging is off, the
        start failed). Called in :data:`WATCH_GROUP`, beside :meth:`start`."""
        return await self._kv_log.wait(poll_s)

    def visible_devices(self) -> tuple[str, str]:
        """``(node, CUDA_VISIBLE_DEVICES)`` of this actor, before its engine starts: the GPU
        whose start order it joins when replicas share GPUs
        (:func:`~torchrl_vllm_ext.engine.driver.cluster.start_lock_key`)."""
        import ray

        return ray.util.get_node_ip_address(), os.environ.get("CUDA_VISIBLE_DEVICES", "")

    # ------------------------------------------------------------------ generation
    async def generate(
        self,
        requests: PromptBatch,
        sampling_params,
        timeout: float | None = None,
        adapter: Adapter | None = None,
    ) -> RequestBatch:
        """Generate a batch; ``sampling_params`` is one ``SamplingParams`` (with the batch's
        per-prompt seeds, if any) or one per prompt.

        ``adapter``: the LoRA adapter (already added) every request of the batch uses.

        On timeout every request of the batch is aborted inside vLLM before
        :class:`GenerationTimeoutError` is raised.
        """
        engine = self._require_engine()
        memory_adapter = adapter.lora_id if adapter is not None and adapter.in_memory else None
        if memory_adapter is not None and not self._memory_adapters.holds(memory_adapter):
            raise InvalidRequestError(
                f"replica {self.replica_id} does not hold LoRA adapter {adapter.name!r} (id "
                f"{adapter.lora_id}): it was removed; name a live adapter (list_loras())."
            )
        prompts = requests.token_lists()
        request_ids = requests.request_ids()
        if isinstance(sampling_params, list | tuple):
            params = list(sampling_params)
        elif requests.seeds is not None:
            params = [with_seed(sampling_params, s) for s in requests.seeds.tolist()]
        else:
            params = [sampling_params] * len(prompts)
        version_start = self._weights.version
        self._outstanding += len(prompts)
        self._inflight.update(request_ids)
        salt = self._weights.cache_salt
        inputs = [{"prompt_token_ids": p, "cache_salt": salt} for p in prompts]
        lora = lora_request(adapter.name, adapter.lora_id, adapter.path) if adapter else None
        if memory_adapter is not None:
            self._memory_adapters.enter(memory_adapter)
        task = asyncio.create_task(engine.generate(inputs, params, request_ids, lora))
        try:
            done = await asyncio.wait_for(task, timeout)
        except TimeoutError:
            await self._abort(task, request_ids)
            raise GenerationTimeoutError(
                f"replica {self.replica_id}: {len(prompts)} requests did not finish within "
                f"timeout={timeout}s and were aborted in vLLM; raise the timeout or lower max_tokens."
            ) from None
        except vllm_validation_errors() as e:
            await self._abort(task, request_ids)
            raise InvalidRequestError(
                f"replica {self.replica_id}: vLLM rejected the request: {e}"
            ) from e
        except engine_dead_errors() as e:
            raise ReplicaDeadError(f"replica {self.replica_id}: the vLLM engine died: {e}") from e
        except BaseException:
            await self._abort(task, request_ids)
            raise
        finally:
            self._outstanding -= len(prompts)
            self._inflight.difference_update(request_ids)
            if memory_adapter is not None:
                self._memory_adapters.leave(memory_adapter)
            switched = self._weights.take_switches(request_ids)
        return pack_outputs(done, self.replica_id, version_start, self._weights.version, switched)

    async def _abort(self, task: asyncio.Task, request_ids) -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        # Cancelling AsyncLLM.generate() aborts its request, an in-process batch is not;
        # abort by id as well (idempotent), which also covers requests never added.
        if self.engine is not None and not self.engine.errored:
            await self.engine.abort(list(request_ids))

    # ------------------------------------------------------------------ LoRA
    async def add_lora(self, adapter: Adapter, files: dict[str, bytes] | None = None) -> str:
        """Load a LoRA adapter (a PEFT directory) so requests can name it; returns the
        directory it was loaded from. ``files``: the directory's files, shipped from a
        driver on another node; written to a private directory here first."""
        if files is not None:
            if self._shipped is None:
                self._shipped = leftovers.owned_dir("torchrl-vllm-replica-adapters-")
            adapter = stage_files(adapter, files, self._shipped)
        request = lora_request(adapter.name, adapter.lora_id, adapter.path)
        try:
            await self._require_engine().add_lora(request)
        except Exception as e:
            raise InvalidRequestError(
                f"replica {self.replica_id}: vLLM could not load LoRA adapter {adapter.name!r} "
                f"from {adapter.path}: {root_cause(e)}; check its rank (<= max_lora_rank) and "
                "target modules, and that the service was launched with enable_lora=True."
            ) from e
        return adapter.path

    async def add_lora_tensors(
        self, adapter: Adapter, tensors: AdapterTensors, version: str | None = None
    ) -> int | None:
        """Load a LoRA adapter from its tensors (no file: every worker builds it from the
        buffer, :data:`WorkerMethods.ADD_LORA_TENSORS`) so requests can name it; then,
        given a ``version``, label the weights so (an adapter push: one call, not two);
        returns its bytes, or None when the tensors lie in the driver's shared memory and
        this process may not map it (the driver then sends them through Ray)."""
        if tensors.shared is not None:
            if not tensors.shared.readable():
                return None
            # the workers map it too (once, then kept) and copy out of it
            data: memoryview | tuple = tensors.shared.as_tuple()
        else:
            # a memoryview: no copy here (the workers copy it once; vLLM's RPC to an
            # engine-core process sends it as bytes)
            data = memoryview(tensors.data)
        try:
            await self._workers.collective_rpc(
                WorkerMethods.ADD_LORA_TENSORS,
                (adapter.lora_id, adapter.name, tensors.header_json, data),
            )
        except WeightSyncError as e:
            raise InvalidRequestError(
                f"replica {self.replica_id}: vLLM could not load LoRA adapter {adapter.name!r} "
                f"from memory: {root_cause(e)}; check its rank (<= max_lora_rank) and target "
                "modules, and that the service was launched with enable_lora=True."
            ) from e
        self._memory_adapters.hold(adapter.lora_id)
        if version is not None:
            await self.set_weight_version(version)
        return tensors.data.nbytes if tensors.shared is None else tensors.shared.nbytes

    async def remove_lora(self, lora_id: int) -> bool:
        """Unload adapter ``lora_id``; one from memory once the batches using it ended."""
        await self._memory_adapters.release(lora_id)
        removed = await self._require_engine().remove_lora(lora_id)
        if self._shipped is not None:
            shutil.rmtree(self._shipped / str(lora_id), ignore_errors=True)
        return removed

    async def list_loras(self) -> set[int]:
        return await self._require_engine().list_loras()

    # ------------------------------------------------------------------ control
    async def stats(self) -> ReplicaStats:
        """Current load from vLLM's scheduler and the actor's counters."""
        load = self._require_engine().load()
        return ReplicaStats(
            replica_id=self.replica_id,
            running=load.running,
            waiting=load.waiting,
            kv_cache_usage=load.kv_cache_usage,
            outstanding=self._outstanding,
            weight_version=self._weights.version,
            paused=not self._state.serving,
        )

    async def check_health(self) -> bool:
        """Raise :class:`ReplicaDeadError` if the engine is gone; True otherwise."""
        engine = self._require_engine()
        try:
            await engine.check_health()
        except Exception as e:
            raise ReplicaDeadError(f"replica {self.replica_id} is unhealthy: {e}") from e
        return True

    async def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause generation with vLLM's modes: ``abort``, ``wait`` (drain) or ``keep`` (freeze)."""
        await self._require_engine().pause(mode, clear_cache)
        self._state = self._state.paused_as(mode, clear_cache)

    async def resume(self) -> None:
        """Resume generation after :meth:`pause` (a sleeping replica resumes once awake)."""
        self._state = self._state.resumed()
        if self._state.serving:
            await self._require_engine().resume()

    async def sleep(self, level: int = 1, mode: PauseMode = "abort") -> None:
        """Free the accelerator's memory (vLLM sleep mode; requests wait until woken)."""
        state = self._state.slept(level)
        await self._require_engine().sleep(level, mode)
        self._state = state
        if level >= 2:  # the weights are discarded: what a load wrote is gone
            await self._workers.forget_served()

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what :meth:`sleep` freed (all, or ``tags``); scheduling resumes once
        everything is awake, unless the service paused this replica."""
        state = self._state.woke(tags)
        engine = self._require_engine()
        await engine.wake_up(None if tags is None else list(tags))
        self._state = state
        if not state.asleep and state.paused is not None:
            # vLLM resumes scheduling on a full wake-up; the service's pause still holds.
            await engine.pause(*state.paused)

    async def is_sleeping(self) -> bool:
        """Whether any part of the replica sleeps (vLLM's own answer is also True when the
        scheduler is merely paused)."""
        return bool(self._state.asleep)

    async def serving_state(self) -> ServingState:
        """The replica's pause and sleep."""
        return self._state

    async def get_weight_version(self) -> str:
        return await self._require_engine().get_weight_version()

    async def set_weight_version(self, version: str) -> None:
        engine = self._require_engine()
        # The requests in flight carry the new label from here (their tokens' versions).
        progress = await engine.tokens_so_far(list(self._inflight)) if self._inflight else {}
        await engine.set_weight_version(str(version))
        self._weights.switched(progress, version)
        self._weights.relabel(version)

    async def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache: call it after the weights changed."""
        self._weights.changed()
        return await self._require_engine().reset_prefix_cache()

    # ------------------------------------------------------------------ worker calls
    # Ray calls methods of the actor's class: each is one line into its part.
    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None):
        """:meth:`.WorkerCalls.collective_rpc`: ``method`` on every vLLM worker."""
        return await self._workers.collective_rpc(method, args, kwargs)

    async def extension_call(self, method: str, args: tuple = ()):
        """:meth:`.WorkerCalls.extension_call`: a public method of the actor extension."""
        return await self._workers.extension_call(method, args)

    async def update_weights(self, method: str, args: tuple, version: str, pause_mode: str) -> dict:
        """:meth:`.WorkerCalls.update_weights`: pause, load, verify, label, resume."""
        return await self._workers.update_weights(method, args, version, pause_mode)

    async def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """:meth:`.WorkerCalls.probe_logprobs`: the value check's scoring request."""
        return await self._workers.probe_logprobs(token_ids)

    # ------------------------------------------------------------------ TorchRL's calls
    # What TorchRL calls on AsyncVLLM's actors (service.actors[i]): one line into its part.
    def ready(self) -> bool:
        return self.engine is not None

    def get_tokenizer(self):
        """:meth:`.TorchRLActorCalls.get_tokenizer`: the served model's tokenizer."""
        return self._torchrl.get_tokenizer()

    async def collective_rpc_v1(
        self, method: str, timeout: float | None = None, args: tuple = (), kwargs=None
    ):
        """:meth:`.TorchRLActorCalls.collective_rpc_v1`: TorchRL's collective_rpc."""
        return await self._torchrl.collective_rpc_v1(method, timeout, args, kwargs)

    def get_world_size(self) -> int:
        """:meth:`.TorchRLActorCalls.get_world_size`: workers of this replica."""
        return self._torchrl.get_world_size()

    async def get_num_unfinished_requests(self) -> int:
        return await self._torchrl.get_num_unfinished_requests()

    async def get_cache_usage(self) -> float:
        return await self._torchrl.get_cache_usage()

    async def init_weight_transfer_engine(self, init_request) -> None:
        """Refused: vLLM's native weight transfer is not served (see :mod:`.torchrl_calls`)."""
        await self._torchrl.init_weight_transfer_engine(init_request)

    async def update_weights_native(self, update_request) -> None:
        """Refused: vLLM's native weight transfer is not served (see :mod:`.torchrl_calls`)."""
        await self._torchrl.update_weights_native(update_request)

    def _release_failed_start(self) -> None:
        """What a start that failed half-way made in this process (the pool kills it
        next): the engine, vLLM's distributed environment, named semaphores, the temporary
        directory."""
        try:
            if self.engine is not None:
                self.engine.shutdown()
                self.engine = None
            release_distributed()
        except Exception:  # the start's own error is the one to report
            logger.debug(
                "replica %d: cleanup after a failed start failed", self.replica_id, exc_info=True
            )
        leftovers.release_semaphores()
        self._remove_tempdir()

    # ------------------------------------------------------------------ lifecycle
    async def shutdown(self) -> None:
        """Stop the engine and its processes."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self._shipped is not None:
            shutil.rmtree(self._shipped, ignore_errors=True)
            self._shipped = None
        # Ray kills this process next: nothing would unlink its locks' semaphores (those
        # made since the start) or remove its temporary directory.
        released = leftovers.release_semaphores()
        logger.debug("replica %d released %d named semaphore(s)", self.replica_id, released)
        self._remove_tempdir()

    def _remove_tempdir(self) -> None:
        if self._tmp is not None:
            leftovers.remove_owned(self._tmp)
            self._tmp = None

    def _require_engine(self) -> Engine:
        if self.engine is None:
            raise ReplicaDeadError(
                f"replica {self.replica_id} has no engine (not started or shut down)."
            )
        return self.engine


def engine_class(in_process: bool) -> type[Engine]:
    """The adapter of an engine kind (imported lazily: each pulls in vLLM)."""
    if in_process:
        from torchrl_vllm_ext.engine.replica.inproc import InprocEngine

        return InprocEngine
    from torchrl_vllm_ext.engine.replica.async_engine import AsyncEngine

    return AsyncEngine
