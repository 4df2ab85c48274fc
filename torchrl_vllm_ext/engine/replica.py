"""The replica: a Ray actor that hosts one vLLM v1 engine.

The engine is ``AsyncLLM`` (engine core in a child process), or on single-worker CPU
replicas vLLM's ``LLMEngine`` stepped by a thread of the actor
(:mod:`torchrl_vllm_ext.engine.inproc`); both offer the same calls here.
One actor call generates a whole batch (the prompts run concurrently inside the
engine); results come back as plain data (:mod:`torchrl_vllm_ext.messages`).
Load statistics are vLLM's own: ``SchedulerStats`` captured by a stat logger the
``AsyncLLM`` calls after every step, or the in-process scheduler's counters.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from torchrl_vllm_ext._compat import engine_dead_errors, vllm_engine_api, vllm_validation_errors
from torchrl_vllm_ext.engine.inproc import InprocEngine
from torchrl_vllm_ext.errors import (
    GenerationTimeoutError,
    InvalidRequestError,
    ReplicaDeadError,
    ReplicaStartupError,
    WeightSyncError,
)
from torchrl_vllm_ext.messages import (
    ReplicaInfo,
    ReplicaStats,
    RequestBatch,
    RequestData,
    SampleData,
)

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")


def _stats_sink_class(sink: dict):
    """A vLLM stat logger that keeps the latest ``SchedulerStats`` in ``sink``."""
    StatLoggerBase = vllm_engine_api()[4]

    class SchedulerStatsSink(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is not None:
                sink["scheduler"] = scheduler_stats

        def log_engine_initialized(self):
            pass

    return SchedulerStatsSink


def _flat_first(flat, length: int) -> np.ndarray:
    """Log-prob of the chosen token at each position of a vLLM ``FlatLogprobs``.

    vLLM puts the chosen (sampled or prompt) token first among a position's entries;
    positions without entries (the first prompt token) get NaN.
    """
    out = np.full(length, np.nan, dtype=np.float32)
    if length == 0 or not flat.logprobs:
        return out
    starts = np.asarray(flat.start_indices, dtype=np.int64)
    ends = np.asarray(flat.end_indices, dtype=np.int64)
    values = np.asarray(flat.logprobs, dtype=np.float32)
    has = ends > starts
    out[: len(starts)][has] = values[starts[has]]
    return out


def to_request_data(output, replica_id: int, version_start: str, version_end: str) -> RequestData:
    """Convert a finished vLLM ``RequestOutput`` into plain data (vectorised per sample)."""
    prompt_ids = np.asarray(output.prompt_token_ids, dtype=np.int64)
    prompt_lp = (
        _flat_first(output.prompt_logprobs, len(prompt_ids))
        if output.prompt_logprobs is not None
        else None
    )
    samples = []
    for comp in output.outputs:
        ids = np.asarray(comp.token_ids, dtype=np.int64)
        lps = _flat_first(comp.logprobs, len(ids)) if comp.logprobs is not None else None
        samples.append(
            SampleData(
                token_ids=ids,
                logprobs=lps,
                finish_reason=comp.finish_reason,
                stop_reason=comp.stop_reason,
                text=comp.text or "",
            )
        )
    return RequestData(
        prompt_token_ids=prompt_ids,
        prompt_logprobs=prompt_lp,
        samples=samples,
        replica_id=replica_id,
        weight_version_start=version_start,
        weight_version_end=version_end,
    )


class VLLMReplica:
    """Ray actor body: one vLLM engine (the service wraps it with ``ray.remote``).

    Args:
        replica_id: stable id of the replica within its service.
        model: local model path.
        engine_kwargs: keyword arguments of vLLM's ``AsyncEngineArgs``.
        weight_version: version label the engine starts with.
        env: environment of the engine's processes (None: unset), which inherit this
            actor's; see :func:`torchrl_vllm_ext.engine.cluster.process_env`.
        in_process: run vLLM's ``LLMEngine`` in this actor instead of ``AsyncLLM`` and
            its engine-core process (single-worker replicas only; see
            :func:`torchrl_vllm_ext.engine.cluster.in_process_engine`).
    """

    def __init__(
        self,
        replica_id: int,
        model: str,
        engine_kwargs: dict,
        weight_version: str,
        env: dict[str, str | None] | None = None,
        in_process: bool = False,
    ):
        for key, value in (env or {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self.replica_id = replica_id
        self._model = model
        self._engine_kwargs = dict(engine_kwargs)
        self._initial_version = weight_version
        self._version = weight_version
        self._sink: dict[str, Any] = {}
        self._outstanding = 0
        self._paused = False
        self._slot_readers: dict[str, Any] = {}  # storage root -> SlotReader (stage_storage)
        self.engine = None
        self._info: ReplicaInfo | None = None
        self._in_process = in_process

    async def start(self) -> ReplicaInfo:
        """Build the engine; return what the router and validators need to know."""
        AsyncLLM, AsyncEngineArgs, *_ = vllm_engine_api()
        kwargs = {"enable_log_requests": False, "disable_log_stats": True}
        kwargs.update(self._engine_kwargs)
        try:
            args = AsyncEngineArgs(model=self._model, **kwargs)
            if self._in_process:
                self.engine = await InprocEngine.start(args)
            else:
                self.engine = AsyncLLM.from_engine_args(
                    args, stat_loggers=[_stats_sink_class(self._sink)]
                )
            await self.engine.update_weight_version(self._initial_version)
        except Exception as e:
            raise ReplicaStartupError(
                f"replica {self.replica_id} could not start vLLM on {self._model!r} "
                f"with {kwargs}: {type(e).__name__}: {e}"
            ) from e
        cfg = self.engine.vllm_config
        tok = self.engine.tokenizer
        vocab_max = cfg.model_config.get_vocab_size() - 1
        import ray

        self._info = ReplicaInfo(
            replica_id=self.replica_id,
            pid=os.getpid(),
            node_ip=ray.util.get_node_ip_address(),
            max_model_len=int(cfg.model_config.max_model_len),
            max_token_id=int(max(vocab_max, tok.max_token_id if tok is not None else 0)),
            kv_capacity_tokens=int(cfg.cache_config.num_gpu_blocks * cfg.cache_config.block_size),
        )
        logger.info("replica %d ready: %s", self.replica_id, self._info)
        return self._info

    def info(self) -> ReplicaInfo | None:
        return self._info

    def child_pids(self) -> list[int]:
        """Processes the engine runs in (for tests that check nothing is left behind)."""
        import psutil

        return [p.pid for p in psutil.Process().children(recursive=True)]

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params,
        request_ids: Sequence[str],
        timeout: float | None = None,
    ) -> RequestBatch:
        """Generate a batch; ``sampling_params`` is one ``SamplingParams`` or one per prompt.

        On timeout every request of the batch is aborted inside vLLM before
        :class:`GenerationTimeoutError` is raised.
        """
        self._require_engine()
        params = (
            list(sampling_params)
            if isinstance(sampling_params, list | tuple)
            else [sampling_params] * len(prompts)
        )
        version_start = self._version
        self._outstanding += len(prompts)
        # Salting the prefix cache with the weight version means cache entries computed
        # with older weights can never serve a request made after a sync.
        salt = f"w{self._version}"
        inputs = [{"prompt_token_ids": list(map(int, p)), "cache_salt": salt} for p in prompts]
        task = asyncio.create_task(self._run_batch(inputs, params, list(request_ids)))
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
        version_end = self._version
        data = [to_request_data(o, self.replica_id, version_start, version_end) for o in done]
        return RequestBatch.pack(data, self.replica_id, version_start, version_end)

    async def _run_batch(self, inputs: list[dict], params: list, request_ids: list[str]) -> list:
        if self._in_process:
            return await self.engine.generate_many(inputs, params, request_ids)
        return await asyncio.gather(
            *(self._one(i, sp, rid) for i, sp, rid in zip(inputs, params, request_ids, strict=True))
        )

    async def _one(self, engine_input: dict, sp, request_id: str):
        final = None
        async for out in self.engine.generate(engine_input, sp, request_id):
            final = out
        return final

    async def _abort(self, task: asyncio.Task, request_ids) -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        # Cancelling AsyncLLM.generate() aborts its request, an in-process batch is not;
        # abort by id as well (idempotent), which also covers requests never added.
        if self.engine is not None and not self.engine.errored:
            await self.engine.abort(list(request_ids))

    async def stats(self) -> ReplicaStats:
        """Current load from vLLM's last ``SchedulerStats`` and the actor's counters."""
        self._require_engine()
        if self._in_process:
            running, waiting, kv_usage = self.engine.load()
        elif sched := self._sink.get("scheduler"):
            running, waiting = int(sched.num_running_reqs), int(sched.num_waiting_reqs)
            kv_usage = float(sched.kv_cache_usage)
        else:
            # Before the engine's first step no SchedulerStats exist; the scheduler then
            # provably holds no request and no cache block, so zeros are the true values.
            running, waiting, kv_usage = 0, 0, 0.0
        return ReplicaStats(
            replica_id=self.replica_id,
            running=running,
            waiting=waiting,
            kv_cache_usage=kv_usage,
            outstanding=self._outstanding,
            weight_version=self._version,
            paused=self._paused,
        )

    async def check_health(self) -> bool:
        """Raise :class:`ReplicaDeadError` if the engine core is gone; True otherwise."""
        self._require_engine()
        try:
            await self.engine.check_health()
        except Exception as e:
            raise ReplicaDeadError(f"replica {self.replica_id} is unhealthy: {e}") from e
        return True

    async def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause generation with vLLM's modes: ``abort``, ``wait`` (drain) or ``keep`` (freeze)."""
        self._require_engine()
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"pause mode {mode!r} is not one of {PAUSE_MODES}.")
        await self.engine.pause_generation(mode=mode, clear_cache=clear_cache)
        self._paused = True

    async def resume(self) -> None:
        self._require_engine()
        await self.engine.resume_generation()
        self._paused = False

    async def get_weight_version(self) -> str:
        self._require_engine()
        return await self.engine.get_weight_version()

    async def set_weight_version(self, version: str) -> None:
        self._require_engine()
        await self.engine.update_weight_version(str(version))
        self._version = str(version)

    async def reset_prefix_cache(self) -> bool:
        self._require_engine()
        return await self.engine.reset_prefix_cache()

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None):
        """Call ``method`` on every vLLM worker (worker extensions live there).

        A failure on a worker is raised as :class:`WeightSyncError` naming the replica
        and the method (the worker extensions are the weight-sync receivers).
        """
        self._require_engine()
        if not isinstance(method, str):
            # An in-process engine would run a callable as is; vLLM's engine-core channel
            # refuses to send one unless insecure serialization is switched on. Refuse both.
            raise InvalidRequestError(
                f"collective_rpc takes the name of a worker method, not {method!r}; callables "
                "are refused (vLLM sends them only when VLLM_ALLOW_INSECURE_SERIALIZATION is on)."
            )
        return await self._worker_call(method, tuple(args), kwargs)

    async def _worker_call(self, method: str, args: tuple, kwargs: dict | None = None):
        try:
            return await self.engine.collective_rpc(method, args=args, kwargs=kwargs)
        except engine_dead_errors() as e:
            raise ReplicaDeadError(f"replica {self.replica_id}: the vLLM engine died: {e}") from e
        except Exception as e:
            # NOTE: vLLM returns a worker's exception as a bare Exception holding only its
            # message; give the caller back a type it can catch.
            raise WeightSyncError(
                f"replica {self.replica_id} (weight version {self._version}): worker call "
                f"{method!r} failed: {e}"
            ) from e

    async def stage_storage(self, root: str, version: str) -> str:
        """Read and checksum the published storage slot ``version`` while generation goes on.

        Runs in this actor, not in the engine: a worker call would hold up the engine's
        steps. The workers then load it in the pause without checksumming it again.
        """
        from torchrl_vllm_ext.weight_sync.storage import SlotReader

        if root not in self._slot_readers:  # keeps each slot mapped once
            self._slot_readers[root] = SlotReader(root)
        reader = self._slot_readers[root]
        manifest, _ = await asyncio.to_thread(reader.read, version)
        return manifest.version

    async def update_weights(self, method: str, args: tuple, version: str, pause_mode: str) -> dict:
        """One weight update, as a short sequence of named steps; returns their timings.

        1) pause generation (``abort`` / ``wait`` / ``keep``), 2) receive or load through
        the worker extension's ``method``, 3) verify every worker reports ``version``,
        4) set the weight version and drop the prefix cache, 5) resume. Generation
        resumes even when a step fails; transports verify before they load, so a
        failed update leaves the previous weights serving.
        """
        import time

        self._require_engine()
        if pause_mode not in PAUSE_MODES:
            raise InvalidRequestError(f"pause mode {pause_mode!r} is not one of {PAUSE_MODES}.")
        t0 = time.perf_counter()
        await self.pause(pause_mode, clear_cache=pause_mode != "keep")  # 1) pause
        t1 = time.perf_counter()
        try:
            reported = await self._worker_call(method, tuple(args))  # 2) load
            t2 = time.perf_counter()
            if any(str(v) != str(version) for v in reported):  # 3) verify
                raise WeightSyncError(
                    f"replica {self.replica_id}: workers loaded versions {reported}, expected {version!r}."
                )
            await self.set_weight_version(version)  # 4) version + cache
            await self.engine.reset_prefix_cache()
        finally:
            await self.resume()  # 5) resume
        t3 = time.perf_counter()
        return {"pause_s": t3 - t0, "pausing_s": t1 - t0, "load_s": t2 - t1}

    async def shutdown(self) -> None:
        """Stop the engine and its processes."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def _require_engine(self) -> None:
        if self.engine is None:
            raise ReplicaDeadError(
                f"replica {self.replica_id} has no engine (not started or shut down)."
            )
