"""vLLM's ``LLMEngine`` inside the replica actor, stepped by one thread (an :class:`Engine`).

``AsyncLLM`` always runs its engine core in a child process: every step's outputs are
serialised, sent over ZMQ and processed again in the actor, while the model's OpenMP
team wants every core. On a CPU replica that costs a third of the throughput of
in-process ``vllm.LLM`` (2 cores, tiny model: 0.68). Here the scheduler, the model
(vLLM's uni executor) and output processing run one after another in one thread, as
in ``vllm.LLM``.

The thread owns the engine (:class:`~.engine_thread.EngineThread`): every operation
(add, abort, pause, worker call) is a closure queued to it and run between two steps, so
nothing needs a lock. Results go back to the actor's event loop as futures. vLLM's
in-process engine core has no ``wait`` pause, so the thread implements all three of
vLLM's pause modes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from torchrl_vllm_ext._compat import (
    EngineLimits,
    PauseMode,
    SchedulerLoad,
    engine_limits,
    inproc_load,
    tokens_so_far,
)
from torchrl_vllm_ext.batches import EVERY_SAMPLE
from torchrl_vllm_ext.engine.replica.engine import Engine
from torchrl_vllm_ext.engine.replica.engine_thread import Batch, EngineThread


class InprocEngine(Engine):
    """One ``LLMEngine`` (no engine-core process) driven by a dedicated thread.

    Build it with ``await InprocEngine.start(engine_args)`` from the event loop the
    results should come back to.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str = "vllm-engine"):
        self._loop = loop
        self.thread = EngineThread(loop, name)
        """Owns the engine; every call below is one closure run on it."""
        self._limits: EngineLimits | None = None

    @classmethod
    def driving(cls, engine, loop: asyncio.AbstractEventLoop) -> InprocEngine:
        """Drive an already built ``LLMEngine`` (or a stand-in with its methods: the seam
        unit tests use), stepping it on a thread of its own; results come back to ``loop``."""
        self = cls(loop)
        self.thread.engine = engine
        self.thread.start()
        return self

    @classmethod
    async def start(cls, engine_args) -> InprocEngine:
        self = cls(asyncio.get_running_loop())
        self.thread.start()
        # Built on its own thread: vLLM's thread-local torch state (grad mode, streams)
        # then belongs to the thread that steps it.
        await self.thread.call(self.thread.build, engine_args)
        engine = self.thread.engine
        self._limits = engine_limits(engine.vllm_config, engine.tokenizer)
        return self

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    @property
    def errored(self) -> bool:
        return self.thread.errored

    async def generate(
        self,
        inputs: Sequence[dict],
        params: Sequence[Any],
        request_ids: Sequence[str],
        lora_request: Any = None,
    ) -> list:
        """All requests are added before the next step, as ``vllm.LLM.generate`` does."""
        futures = [self._loop.create_future() for _ in request_ids]
        batch = Batch(list(inputs), list(params), list(request_ids), futures, lora_request)
        await self.thread.call(self.thread.add_batch, batch)
        return list(await asyncio.gather(*futures))

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests by id; their callers get a final output with reason ``abort``."""
        await self.thread.call(self.thread.abort, set(request_ids))

    async def _pause(self, mode: PauseMode, clear_cache: bool) -> None:
        # Requests submitted while paused are held until resume().
        idle = self._loop.create_future() if mode == "wait" else None
        await self.thread.call(self.thread.pause, mode, idle)
        if idle is not None:
            await idle
        if clear_cache:
            await self.thread.call(self.thread.clear_caches)

    async def resume(self) -> None:
        await self.thread.call(self.thread.resume)

    async def update_call(
        self, method: str, args: tuple, pause_mode: PauseMode | None, clear_cache: bool
    ) -> list:
        """Pause, clear the caches and call the workers in one call of the engine thread
        (between two steps); a ``wait`` pause drains first (the default's two calls)."""
        if pause_mode == "wait":
            return await super().update_call(method, args, pause_mode, clear_cache)
        thread = self.thread

        def pause_and_call():
            if pause_mode is not None:
                thread.pause(pause_mode, None)
                if clear_cache:
                    thread.clear_caches()
            return thread.engine.collective_rpc(method, args=args)

        return await thread.call(pause_and_call)

    async def finish_update(self, version: str, reset_cache: bool, resume: bool) -> None:
        """Label, reset the prefix cache and resume in one call of the engine thread."""
        thread = self.thread

        def label_and_resume():
            try:
                thread.engine.set_weight_version(version)
                if reset_cache:
                    thread.engine.reset_prefix_cache()
            finally:
                if resume:
                    thread.resume()

        await thread.call(label_and_resume)

    async def set_weight_version(self, version: str) -> None:
        await self.thread.call(lambda: self.thread.engine.set_weight_version(version))

    async def get_weight_version(self) -> str:
        return await self.thread.call(lambda: self.thread.engine.get_weight_version())

    async def reset_prefix_cache(self) -> bool:
        return await self.thread.call(lambda: self.thread.engine.reset_prefix_cache())

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None):
        return await self.thread.call(
            lambda: self.thread.engine.collective_rpc(method, args=args, kwargs=kwargs)
        )

    async def check_health(self) -> None:
        """Raise if the engine died; otherwise return once the thread ran a no-op."""
        await self.thread.call(lambda: None)

    async def add_lora(self, lora_request) -> bool:
        return await self.thread.call(lambda: self.thread.engine.add_lora(lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        return await self.thread.call(lambda: self.thread.engine.remove_lora(lora_id))

    async def list_loras(self) -> set[int]:
        return await self.thread.call(lambda: set(self.thread.engine.list_loras()))

    async def tokens_so_far(self, request_ids: Sequence[str]) -> dict[tuple[str, int], int]:
        ids = set(request_ids)

        def count():  # on the engine thread: the held batches and the counts agree
            held = ids & self.thread.held_request_ids()
            return tokens_so_far(self.thread.engine.output_processor, ids) | {
                (rid, EVERY_SAMPLE): 0 for rid in held
            }

        return await self.thread.call(count)

    def load(self) -> SchedulerLoad:
        """Read from the actor's thread without queueing (a few int reads; the GIL makes
        each consistent), so stats never wait for a step or a weight load. Held batches
        count as waiting."""
        engine = self.thread.engine
        if engine is None:
            return SchedulerLoad(0, 0, 0.0)
        load = inproc_load(engine)
        return load._replace(waiting=load.waiting + self.thread.held_requests())

    def shutdown(self) -> None:
        """Stop the thread and the engine; pending callers get ``EngineDeadError``."""
        self.thread.stop()


__all__ = ["InprocEngine"]
