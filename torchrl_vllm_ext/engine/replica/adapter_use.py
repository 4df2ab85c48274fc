"""AdapterUse: which adapters from memory a replica holds, and the batches using each.

vLLM reloads an adapter its workers do not hold from the request's ``lora_path`` at the
next engine step, and a failed reload fails the step (the engine dies). An adapter from
memory has no file there, so the replica keeps two rules: a batch may name only an
adapter from memory the replica holds (else a typed error, before vLLM sees it), and
removing one waits until the batches already using it finished.

Examples:
    >>> import asyncio
    >>> use = AdapterUse()
    >>> use.hold(7)
    >>> use.enter(7)
    >>> async def retire():
    ...     waiting = asyncio.ensure_future(use.release(7))
    ...     await asyncio.sleep(0)
    ...     done_early = waiting.done()
    ...     use.leave(7)
    ...     await waiting
    ...     return done_early, use.holds(7)
    >>> asyncio.run(retire())
    (False, False)
"""

from __future__ import annotations

import asyncio


class AdapterUse:
    """Adapters from memory held by one replica, and how many batches use each."""

    def __init__(self):
        self._held: set[int] = set()
        self._users: dict[int, int] = {}
        self._idle: dict[int, asyncio.Event] = {}

    def hold(self, lora_id: int) -> None:
        """The workers registered ``lora_id``: batches may name it."""
        self._held.add(lora_id)

    def holds(self, lora_id: int) -> bool:
        return lora_id in self._held

    def enter(self, lora_id: int) -> None:
        """A batch naming ``lora_id`` starts (call it right after :meth:`holds`)."""
        self._users[lora_id] = self._users.get(lora_id, 0) + 1
        self._idle.setdefault(lora_id, asyncio.Event()).clear()

    def leave(self, lora_id: int) -> None:
        """A batch naming ``lora_id`` ended (finished, failed or aborted)."""
        left = self._users.get(lora_id, 0) - 1
        if left > 0:
            self._users[lora_id] = left
            return
        self._users.pop(lora_id, None)
        idle = self._idle.pop(lora_id, None)
        if idle is not None:
            idle.set()

    async def release(self, lora_id: int) -> None:
        """Refuse new batches naming ``lora_id``; return once none uses it."""
        self._held.discard(lora_id)
        idle = self._idle.get(lora_id)
        if idle is not None:
            await idle.wait()


__all__ = ["AdapterUse"]
