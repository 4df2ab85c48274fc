"""vLLM's ``AsyncLLM`` behind the replica's :class:`~torchrl_vllm_ext.engine.replica.engine.Engine`.

The engine core runs in a child process (GPU and tensor/pipeline-parallel replicas,
whose engine core overlaps output processing with the next step). Load statistics are
vLLM's own ``SchedulerStats``, captured by a stat logger ``AsyncLLM`` calls after
every step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from torchrl_vllm_ext._compat import (
    EngineLimits,
    PauseMode,
    SchedulerLoad,
    async_pause,
    engine_limits,
    keeps_weight_version,
    pause_then,
    retryable_errors,
    tokens_so_far,
    vllm_engine_api,
)
from torchrl_vllm_ext.batches import EVERY_SAMPLE
from torchrl_vllm_ext.engine.replica.engine import Engine


def _stats_sink(sink: dict):
    """A vLLM stat logger class that keeps the latest ``SchedulerStats`` in ``sink``."""

    class SchedulerStatsSink(vllm_engine_api().StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is not None:
                sink["scheduler"] = scheduler_stats

        def log_engine_initialized(self):
            pass

    return SchedulerStatsSink


class AsyncEngine(Engine):
    """One ``AsyncLLM`` (engine core in a child process)."""

    def __init__(self, llm, sink: dict):
        self._llm = llm
        self._sink = sink
        self._limits = engine_limits(llm.vllm_config, llm.tokenizer)
        self._version = "0"  # the label, where vLLM keeps none (0.26)
        self._labels = keeps_weight_version(llm)
        self._resumed = asyncio.Event()  # requests vLLM refused during a pause wait on it
        self._resumed.set()
        self._submitted: set[str] = set()  # request ids whose generate() has not returned
        self._retryable = retryable_errors()

    @classmethod
    async def start(cls, engine_args) -> AsyncEngine:
        sink: dict = {}
        llm = vllm_engine_api().AsyncLLM.from_engine_args(
            engine_args, stat_loggers=[_stats_sink(sink)]
        )
        return cls(llm, sink)

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    @property
    def errored(self) -> bool:
        return self._llm.errored

    async def generate(
        self,
        inputs: Sequence[dict],
        params: Sequence[Any],
        request_ids: Sequence[str],
        lora_request: Any = None,
    ) -> list:
        return list(
            await asyncio.gather(
                *(
                    self._one(i, p, r, lora_request)
                    for i, p, r in zip(inputs, params, request_ids, strict=True)
                )
            )
        )

    async def _one(self, engine_input: dict, params, request_id: str, lora_request=None):
        self._submitted.add(request_id)
        try:
            return await self._until_done(engine_input, params, request_id, lora_request)
        finally:
            self._submitted.discard(request_id)

    async def _until_done(self, engine_input: dict, params, request_id: str, lora_request):
        while True:
            final = None
            try:
                async for out in self._llm.generate(
                    engine_input, params, request_id, lora_request=lora_request
                ):
                    final = out
                return final
            except self._retryable:
                # vLLM 0.33 refuses requests during a pause (earlier versions queue them):
                # queue it here, as the other engines do.
                if final is not None:
                    raise
                if self._resumed.is_set():  # a pause that is not ours (a sleep): poll
                    await asyncio.sleep(0.01)
                await self._resumed.wait()

    async def add_lora(self, lora_request) -> bool:
        return await self._llm.add_lora(lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._llm.remove_lora(lora_id)

    async def list_loras(self) -> set[int]:
        return set(await self._llm.list_loras())

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self._llm.abort(list(request_ids))

    async def _pause(self, mode: PauseMode, clear_cache: bool) -> None:
        self._resumed.clear()
        await async_pause(self._llm, mode, clear_cache)

    async def resume(self) -> None:
        await self._llm.resume_generation()
        self._resumed.set()

    async def update_call(
        self, method: str, args: tuple, pause_mode: PauseMode | None, clear_cache: bool
    ) -> list:
        """The engine core's pause and the workers' call sent back to back (one round trip);
        a ``wait`` pause drains first."""
        if pause_mode not in ("abort", "keep"):
            return await super().update_call(method, args, pause_mode, clear_cache)
        self._resumed.clear()
        return await pause_then(
            self._llm, pause_mode, clear_cache, lambda: self.collective_rpc(method, args)
        )

    async def finish_update(self, version: str, reset_cache: bool, resume: bool) -> None:
        """The label, the prefix-cache reset and the resume sent back to back (one round
        trip: the engine core handles them in order)."""
        self._version = version
        calls = []
        if self._labels:
            calls.append(lambda: self._llm.update_weight_version(version))
        if reset_cache:
            calls.append(self._llm.reset_prefix_cache)
        if resume:
            calls.append(self._llm.resume_generation)
        try:
            await in_order(calls)
        finally:
            if resume:
                self._resumed.set()

    async def sleep(self, level: int, mode: PauseMode) -> None:
        await self._llm.sleep(level, mode)

    async def wake_up(self, tags: list[str] | None) -> None:
        await self._llm.wake_up(tags)

    async def is_sleeping(self) -> bool:
        return await self._llm.is_sleeping()

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None):
        return await self._llm.collective_rpc(method, args=args, kwargs=kwargs)

    async def tokens_so_far(self, request_ids: Sequence[str]) -> dict[tuple[str, int], int]:
        ids = set(request_ids)
        counts = tokens_so_far(self._llm.output_processor, ids)
        # Submitted but unknown to the output processor: waiting to be added (refused
        # during the pause); a finished request has left _submitted by now (the update's
        # load ran between its last output and this call).
        started = {rid for rid, _ in counts}
        waiting = (ids & self._submitted) - started
        return counts | {(rid, EVERY_SAMPLE): 0 for rid in waiting}

    def load(self) -> SchedulerLoad:
        sched = self._sink.get("scheduler")
        if sched is None:
            # Before the engine's first step no SchedulerStats exist; the scheduler then
            # provably holds no request and no cache block, so zeros are the true values.
            return SchedulerLoad(0, 0, 0.0)
        return SchedulerLoad(
            int(sched.num_running_reqs), int(sched.num_waiting_reqs), float(sched.kv_cache_usage)
        )

    async def reset_prefix_cache(self) -> bool:
        return await self._llm.reset_prefix_cache()

    async def set_weight_version(self, version: str) -> None:
        self._version = version
        if self._labels:
            await self._llm.update_weight_version(version)

    async def get_weight_version(self) -> str:
        return await self._llm.get_weight_version() if self._labels else self._version

    async def check_health(self) -> None:
        await self._llm.check_health()

    def shutdown(self) -> None:
        self._llm.shutdown()


async def in_order(calls) -> list:
    """Run coroutine functions that each send one engine-core request, every request sent
    before any answer is awaited, in the given order (each task runs to its send before
    the next starts; see :func:`~torchrl_vllm_ext._compat.pause_then`); their results."""
    tasks = []
    for call in calls:
        tasks.append(asyncio.ensure_future(call()))
        await asyncio.sleep(0)  # this request leaves before the next one
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return list(results)
