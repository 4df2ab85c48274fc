"""vLLM's ``LLMEngine`` inside the replica actor, stepped by one thread (an :class:`Engine`).

``AsyncLLM`` always runs its engine core in a child process: every step's outputs are
serialised, sent over ZMQ and processed again in the actor, while the model's OpenMP
team wants every core. On a CPU replica that costs a third of the throughput of
in-process ``vllm.LLM`` (2 cores, tiny model: 0.68). Here the scheduler, the model
(vLLM's uni executor) and output processing run one after another in one thread, as
in ``vllm.LLM``.

The thread owns the engine: every operation (add, abort, pause, worker call) is a
closure queued to it and run between two steps, so nothing needs a lock. Results go
back to the actor's event loop as futures. vLLM's in-process engine core has no
``wait`` pause, so the thread implements all three of vLLM's pause modes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from torchrl_vllm_ext._compat import (
    EngineLimits,
    PauseMode,
    SchedulerLoad,
    engine_dead_error,
    engine_limits,
    inproc_abort,
    inproc_build,
    inproc_load,
    inproc_shutdown,
    tokens_so_far,
)
from torchrl_vllm_ext.engine.replica.engine import Engine

logger = logging.getLogger(__name__)

_STOP = object()


class _Batch(NamedTuple):
    """Requests submitted together, with the futures their outputs go to."""

    inputs: list
    params: list
    request_ids: list[str]
    futures: list[asyncio.Future]
    lora_request: Any = None


class InprocEngine(Engine):
    """One ``LLMEngine`` (no engine-core process) driven by a dedicated thread.

    Build it with ``await InprocEngine.start(engine_args)`` from the event loop the
    results should come back to.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str = "vllm-engine"):
        self._loop = loop
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._engine = None  # owned by the thread
        self._waiters: dict[str, asyncio.Future] = {}  # request id -> final output
        self._held: list[_Batch] = []  # batches submitted while paused
        self._idle_waiters: list[asyncio.Future] = []  # pause("wait") callers
        self._paused = False
        self._frozen = False  # pause("keep"): no steps at all
        self._error: BaseException | None = None
        self._limits: EngineLimits | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @classmethod
    def driving(cls, engine, loop: asyncio.AbstractEventLoop) -> InprocEngine:
        """Drive an already built ``LLMEngine`` (or a stand-in with its methods: the seam
        unit tests use), stepping it on a thread of its own; results come back to ``loop``."""
        self = cls(loop)
        self._engine = engine
        self._thread.start()
        return self

    @classmethod
    async def start(cls, engine_args) -> InprocEngine:
        self = cls(asyncio.get_running_loop())
        self._thread.start()
        # Built on its own thread: vLLM's thread-local torch state (grad mode, streams)
        # then belongs to the thread that steps it.
        await self._call(self._build, engine_args)
        self._limits = engine_limits(self._engine.vllm_config, self._engine.tokenizer)
        return self

    # ------------------------------------------------------------ Engine
    @property
    def limits(self) -> EngineLimits:
        return self._limits

    @property
    def errored(self) -> bool:
        return self._error is not None or not self._thread.is_alive()

    async def generate(
        self,
        inputs: Sequence[dict],
        params: Sequence[Any],
        request_ids: Sequence[str],
        lora_request: Any = None,
    ) -> list:
        """All requests are added before the next step, as ``vllm.LLM.generate`` does."""
        futures = [self._loop.create_future() for _ in request_ids]
        batch = _Batch(list(inputs), list(params), list(request_ids), futures, lora_request)
        await self._call(self._add_batch, batch)
        return list(await asyncio.gather(*futures))

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests by id; their callers get a final output with reason ``abort``."""
        await self._call(self._abort, set(request_ids))

    async def _pause(self, mode: PauseMode, clear_cache: bool) -> None:
        # Requests submitted while paused are held until resume().
        idle = self._loop.create_future() if mode == "wait" else None
        await self._call(self._pause_steps, mode, idle)
        if idle is not None:
            await idle
        if clear_cache:
            await self._call(self._clear_caches)

    async def resume(self) -> None:
        await self._call(self._resume)

    async def update_call(
        self, method: str, args: tuple, pause_mode: PauseMode | None, clear_cache: bool
    ) -> list:
        """Pause, clear the caches and call the workers in one call of the engine thread
        (between two steps); a ``wait`` pause drains first (the default's two calls)."""
        if pause_mode == "wait":
            return await super().update_call(method, args, pause_mode, clear_cache)

        def pause_and_call():
            if pause_mode is not None:
                self._pause_steps(pause_mode, None)
                if clear_cache:
                    self._clear_caches()
            return self._engine.collective_rpc(method, args=args)

        return await self._call(pause_and_call)

    async def finish_update(self, version: str, reset_cache: bool, resume: bool) -> None:
        """Label, reset the prefix cache and resume in one call of the engine thread."""

        def label_and_resume():
            try:
                self._engine.set_weight_version(version)
                if reset_cache:
                    self._engine.reset_prefix_cache()
            finally:
                if resume:
                    self._resume()

        await self._call(label_and_resume)

    async def set_weight_version(self, version: str) -> None:
        await self._call(lambda: self._engine.set_weight_version(version))

    async def get_weight_version(self) -> str:
        return await self._call(lambda: self._engine.get_weight_version())

    async def reset_prefix_cache(self) -> bool:
        return await self._call(lambda: self._engine.reset_prefix_cache())

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None):
        return await self._call(
            lambda: self._engine.collective_rpc(method, args=args, kwargs=kwargs)
        )

    async def check_health(self) -> None:
        """Raise if the engine died; otherwise return once the thread ran a no-op."""
        await self._call(lambda: None)

    async def add_lora(self, lora_request) -> bool:
        return await self._call(lambda: self._engine.add_lora(lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._call(lambda: self._engine.remove_lora(lora_id))

    async def list_loras(self) -> set[int]:
        return await self._call(lambda: set(self._engine.list_loras()))

    async def tokens_so_far(self, request_ids: Sequence[str]) -> dict[tuple[str, int], int]:
        ids = set(request_ids)
        return await self._call(lambda: tokens_so_far(self._engine.output_processor, ids))

    def load(self) -> SchedulerLoad:
        """Read from the actor's thread without queueing (a few int reads; the GIL makes
        each consistent), so stats never wait for a step or a weight load. Held batches
        count as waiting."""
        if self._engine is None:
            return SchedulerLoad(0, 0, 0.0)
        load = inproc_load(self._engine)
        held = sum(len(batch.request_ids) for batch in self._held)
        return load._replace(waiting=load.waiting + held)

    def shutdown(self) -> None:
        """Stop the thread and the engine; pending callers get ``EngineDeadError``."""
        if self._thread.is_alive():
            self._calls.put(_STOP)
            self._thread.join(timeout=60)

    # ------------------------------------------------------------ caller side
    async def _call(self, fn: Callable, *args) -> Any:
        """Run ``fn(*args)`` on the engine thread between two steps; return its result."""
        if self.errored:
            raise self._dead_error()
        future = self._loop.create_future()
        self._calls.put((fn, args, future))
        return await future

    def _dead_error(self):
        cause = self._error if self._error is not None else "engine thread stopped"
        error = engine_dead_error(f"in-process vLLM engine is gone: {cause}")
        error.__cause__ = self._error  # the engine's own exception: the root cause
        return error

    def _resolve(self, future: asyncio.Future, result=None, error: BaseException | None = None):
        """Complete ``future`` on the event loop (called from the engine thread)."""

        def done():
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        self._post(done)

    def _post(self, fn: Callable) -> None:
        try:
            self._loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the actor's loop is closed: nobody waits any more
            pass

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while True:
                busy = self._has_work()
                try:
                    item = self._calls.get(block=not busy)
                except queue.Empty:
                    item = None
                while item is not None:
                    if item is _STOP:
                        self._close()
                        return
                    self._run_call(*item)
                    try:
                        item = self._calls.get_nowait()
                    except queue.Empty:
                        item = None
                if self._has_work():
                    self._step()
                if self._idle_waiters and not self._engine.has_unfinished_requests():
                    for future in self._idle_waiters:
                        self._resolve(future)
                    self._idle_waiters.clear()
        except BaseException as e:  # a failed step: the engine's state is unknown
            logger.exception("in-process vLLM engine failed")
            self._error = e
            self._close()

    def _run_call(self, fn: Callable, args: tuple, future: asyncio.Future) -> None:
        try:
            result = fn(*args)
        except Exception as e:  # the caller's error; the engine goes on
            self._resolve(future, error=e)
        except BaseException:
            self._resolve(future, error=self._dead_error())
            raise
        else:
            self._resolve(future, result)

    def _has_work(self) -> bool:
        return (
            self._engine is not None and not self._frozen and self._engine.has_unfinished_requests()
        )

    def _step(self) -> None:
        outputs = self._engine.step()
        self._deliver(outputs)

    def _deliver(self, outputs) -> None:
        done = [(self._waiters.pop(o.request_id, None), o) for o in outputs if o.finished]
        if done:

            def resolve_all():
                for future, output in done:
                    if future is not None and not future.done():
                        future.set_result(output)

            self._post(resolve_all)

    def _close(self) -> None:
        """Fail every pending caller and release the engine (thread exits after)."""
        error = self._dead_error()
        pending = list(self._waiters.values()) + self._idle_waiters
        pending += [f for batch in self._held for f in batch.futures]
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                pending.append(item[2])
        for future in pending:
            self._resolve(future, error=error)
        self._waiters.clear()
        self._held.clear()
        self._idle_waiters.clear()
        if self._engine is not None:
            try:
                inproc_shutdown(self._engine)
            except Exception:
                logger.exception("in-process vLLM engine shutdown failed")
        if self._error is None:
            self._error = RuntimeError("shut down")

    def _build(self, engine_args) -> None:
        self._engine = inproc_build(engine_args)

    def _add_batch(self, batch: _Batch) -> None:
        if self._paused:
            self._held.append(batch)
            return
        added: list[str] = []
        try:
            lora = {"lora_request": batch.lora_request} if batch.lora_request else {}
            for prompt, sp, rid, future in zip(*batch[:4], strict=True):
                self._engine.add_request(rid, prompt, sp, **lora)
                self._waiters[rid] = future
                added.append(rid)
        except Exception:
            if added:
                self._engine.abort_request(added)
                for rid in added:
                    self._waiters.pop(rid, None)
            raise

    def _abort(self, external_ids: set[str] | None) -> None:
        """Abort in-flight requests (all if ``external_ids`` is None); their callers get
        final outputs with finish reason ``abort`` and their partial tokens."""
        self._deliver(inproc_abort(self._engine, external_ids))
        if external_ids:  # held batches the caller gave up on never start
            dropped = [b for b in self._held if external_ids.intersection(b.request_ids)]
            self._held = [b for b in self._held if not external_ids.intersection(b.request_ids)]
            for future in (f for batch in dropped for f in batch.futures):
                self._post(future.cancel)

    def _pause_steps(self, mode: PauseMode, idle: asyncio.Future | None) -> None:
        self._paused = True
        if mode == "abort":
            self._abort(None)
        elif mode == "keep":
            self._frozen = True
        else:  # "wait" (the mode was checked by Engine.pause)
            self._idle_waiters.append(idle)

    def _clear_caches(self) -> None:
        # As vLLM's pause(clear_cache=True): running requests lose their cached blocks
        # too and recompute them on resume.
        self._engine.reset_prefix_cache(reset_running_requests=True)
        self._engine.reset_mm_cache()

    def _resume(self) -> None:
        self._paused = self._frozen = False
        held, self._held = self._held, []
        for batch in held:
            try:
                self._add_batch(batch)
            except Exception as e:
                for future in batch.futures:
                    self._resolve(future, error=e)
