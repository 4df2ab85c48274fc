"""A private asyncio loop on a daemon thread, so sync and async callers share one code path.

The service keeps all of its state on this loop (no locks needed); sync methods
block on a future, async methods await a wrapped one. It also lets the service be
used from notebooks, whose main thread already runs a loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """Owns a running event loop on a background thread until :meth:`close`."""

    def __init__(self, name: str = "torchrl-vllm-service"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block until it finishes."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.run() called from its own loop; await instead")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def arun(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop from another event loop, awaiting its result."""
        if asyncio.get_running_loop() is self.loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()
