"""EngineThread: the one thread that owns a vLLM ``LLMEngine`` and steps it.

Every operation on the engine (add, abort, pause, a worker call) is a closure queued to
the thread and run between two steps, so nothing needs a lock; results go back to the
caller's event loop as futures. The thread also holds what only it changes: the requests
waiting for their final output, the batches held while paused, and the pause itself
(vLLM's in-process engine core has no ``wait`` pause, so the three modes are written
here). :class:`~torchrl_vllm_ext.engine.replica.inproc.InprocEngine` drives one.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from torchrl_vllm_ext._compat import (
    PauseMode,
    engine_dead_error,
    inproc_abort,
    inproc_build,
    inproc_shutdown,
)

logger = logging.getLogger(__name__)

_STOP = object()


class Batch(NamedTuple):
    """Requests submitted together, with the futures their outputs go to."""

    inputs: list
    params: list
    request_ids: list[str]
    futures: list[asyncio.Future]
    lora_request: Any = None


class EngineThread:
    """A daemon thread that owns one ``LLMEngine`` and steps it while it has work.

    Args:
        loop: the event loop the results go back to.
        name: the thread's name.

    Examples:
        >>> import asyncio
        >>> async def main():
        ...     thread = EngineThread(asyncio.get_running_loop())
        ...     thread.start()
        ...     try:
        ...         return await thread.call(lambda: 1 + 1)
        ...     finally:
        ...         thread.stop()
        >>> asyncio.run(main())
        2
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str = "vllm-engine"):
        self._loop = loop
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.engine = None
        """The ``LLMEngine`` (touched on the thread only, through :meth:`call`)."""
        self._waiters: dict[str, asyncio.Future] = {}  # request id -> final output
        self._held: list[Batch] = []  # batches submitted while paused
        self._idle_waiters: list[asyncio.Future] = []  # pause("wait") callers
        self.paused = False
        """Whether new batches are held until :meth:`resume` (written on the thread)."""
        self._frozen = False  # pause("keep"): no steps at all
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and the engine; pending callers get ``EngineDeadError``."""
        if self._thread.is_alive():
            self._calls.put(_STOP)
            self._thread.join(timeout=60)

    @property
    def errored(self) -> bool:
        return self._error is not None or not self._thread.is_alive()

    def held_requests(self) -> int:
        """How many requests wait in batches held by the pause (read from any thread)."""
        return sum(len(batch.request_ids) for batch in self._held)

    def held_request_ids(self) -> set[str]:
        """The ids of the requests held by the pause (not started yet)."""
        return {rid for batch in self._held for rid in batch.request_ids}

    # ------------------------------------------------------------ caller side
    async def call(self, fn: Callable, *args) -> Any:
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
        except RuntimeError:  # the caller's loop is closed: nobody waits any more
            pass

    # ------------------------------------------------------------ on the thread
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
                    self._deliver(self.engine.step())
                if self._idle_waiters and not self.engine.has_unfinished_requests():
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
            self.engine is not None and not self._frozen and self.engine.has_unfinished_requests()
        )

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
        if self.engine is not None:
            try:
                inproc_shutdown(self.engine)
            except Exception:
                logger.exception("in-process vLLM engine shutdown failed")
        if self._error is None:
            self._error = RuntimeError("shut down")

    # ------------------------------------------------------------ operations (on the thread)
    def build(self, engine_args) -> None:
        self.engine = inproc_build(engine_args)

    def add_batch(self, batch: Batch) -> None:
        """Add every request of ``batch`` (held instead while paused); none if one fails."""
        if self.paused:
            self._held.append(batch)
            return
        added: list[str] = []
        try:
            lora = {"lora_request": batch.lora_request} if batch.lora_request else {}
            for prompt, sp, rid, future in zip(*batch[:4], strict=True):
                self.engine.add_request(rid, prompt, sp, **lora)
                self._waiters[rid] = future
                added.append(rid)
        except Exception:
            if added:
                self.engine.abort_request(added)
                for rid in added:
                    self._waiters.pop(rid, None)
            raise

    def abort(self, external_ids: set[str] | None) -> None:
        """Abort in-flight requests (all if ``external_ids`` is None); their callers get
        final outputs with finish reason ``abort`` and their partial tokens."""
        self._deliver(inproc_abort(self.engine, external_ids))
        if external_ids:  # held batches the caller gave up on never start
            dropped = [b for b in self._held if external_ids.intersection(b.request_ids)]
            self._held = [b for b in self._held if not external_ids.intersection(b.request_ids)]
            for future in (f for batch in dropped for f in batch.futures):
                self._post(future.cancel)

    def pause(self, mode: PauseMode, idle: asyncio.Future | None) -> None:
        """Hold new batches; ``abort`` the running requests, freeze them (``keep``), or
        resolve ``idle`` once they finished (``wait``)."""
        self.paused = True
        if mode == "abort":
            self.abort(None)
        elif mode == "keep":
            self._frozen = True
        else:  # "wait" (the mode was checked by Engine.pause)
            self._idle_waiters.append(idle)

    def clear_caches(self) -> None:
        # As vLLM's pause(clear_cache=True): running requests lose their cached blocks
        # too and recompute them on resume.
        self.engine.reset_prefix_cache(reset_running_requests=True)
        self.engine.reset_mm_cache()

    def resume(self) -> None:
        """Step again and add the held batches (a batch that fails fails its callers)."""
        self.paused = self._frozen = False
        held, self._held = self._held, []
        for batch in held:
            try:
                self.add_batch(batch)
            except Exception as e:
                for future in batch.futures:
                    self._resolve(future, error=e)


__all__ = ["Batch", "EngineThread"]
