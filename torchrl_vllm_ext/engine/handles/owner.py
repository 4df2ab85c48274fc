"""Who may do what on a :class:`~torchrl_vllm_ext.VLLMService`: its owner (the process
that launched it) or a handle (the service pickled into another Ray process), and the
methods written once for both of them.

* :func:`sync_and_async`: one coroutine that runs on the service's event loop makes both the
  blocking method and its ``a``-prefixed awaitable form; :func:`delegate_sync_and_async`
  makes them of a part's coroutine methods.
* :func:`owner_only`: the owner runs the method; a handle forwards the call to the owner
  through the service's directory and returns its answer (the owner pushes, pauses,
  adds replicas and adapters, and keeps the one weight version and death policy).
* :data:`DEPRECATED`: the old method names, in one place.
* :func:`close_at_exit`: an owner never shut down is closed when its process exits.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import inspect
import warnings
import weakref
from collections.abc import Callable

FORWARDED: set[str] = set()
"""Methods a handle forwards to the owner (and the only ones the owner runs for it)."""

DEPRECATED = {
    "generate_batch": "generate_request_data",
    "agenerate_batch": "agenerate_request_data",
    "generate_flat": "generate_request_batch",
    "agenerate_flat": "agenerate_request_batch",
}
"""Old method name -> new (same arguments, same result); removed in the next release."""


def owner_only(fn: Callable) -> Callable:
    """Run ``fn`` on the owner; a handle forwards the call (its arguments must pickle)."""
    FORWARDED.add(fn.__name__)

    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        if self.is_owner:
            return fn(self, *args, **kwargs)
        return self._forward(fn.__name__, args, kwargs)

    return method


def delegate(cls: type, part: str, part_cls: type, names: list[str], owner: bool = False):
    """Give ``cls`` each method or property ``name`` of its part ``self.<part>`` (an
    instance of ``part_cls``), same name, same docstring: composition, one line per part.
    With ``owner``, the methods are :func:`owner_only`."""
    for name in names:
        setattr(cls, name, _delegated(part_cls, part, name, owner))


def _delegated(part_cls: type, part: str, name: str, owner: bool):
    target = inspect.getattr_static(part_cls, name)
    if isinstance(target, property):
        return property(lambda self: getattr(getattr(self, part), name), doc=target.__doc__)

    @functools.wraps(target)
    def method(self, *args, **kwargs):
        return getattr(getattr(self, part), name)(*args, **kwargs)

    return owner_only(method) if owner else method


def delegate_sync_and_async(
    cls: type,
    part: str,
    part_cls: type,
    names: list[str],
    owner: bool = False,
    async_forms: bool = True,
) -> None:
    """Give ``cls``, for each coroutine method ``name`` of its part ``self.<part>`` (an
    instance of ``part_cls``), the blocking method ``name`` and (``async_forms``) its
    ``a``-prefixed form, made by :func:`sync_and_async` of a one-line delegation: same
    name, same docstring. With ``owner``, both are :func:`owner_only`."""
    for name in names:
        sync, async_ = sync_and_async(_part_coroutine(part_cls, part, name), owner)
        setattr(cls, name, sync)
        if async_forms:
            setattr(cls, f"a{name}", async_)


def _part_coroutine(part_cls: type, part: str, name: str) -> Callable:
    target = getattr(part_cls, name)

    async def work(self, *args, **kwargs):
        return await getattr(getattr(self, part), name)(*args, **kwargs)

    return functools.update_wrapper(work, target)


def sync_and_async(work: Callable, owner: bool = False) -> tuple[Callable, Callable]:
    """``(sync, async)`` methods from ``work(self, ...)``, a coroutine function that runs
    on the service's event loop. With ``owner``, both are :func:`owner_only` (the async
    form forwards from a thread)."""
    name = work.__name__.lstrip("_")

    def sync(self, *args, **kwargs):
        return self.run(work(self, *args, **kwargs))

    async def async_(self, *args, **kwargs):
        if owner and not self.is_owner:
            return await asyncio.to_thread(self._forward, name, args, kwargs)
        return await self.arun(work(self, *args, **kwargs))

    functools.update_wrapper(sync, work)
    sync.__name__ = sync.__qualname__ = name
    functools.update_wrapper(async_, work)
    async_.__name__ = async_.__qualname__ = f"a{name}"
    async_.__doc__ = f"Async :meth:`{name}`."
    return (owner_only(sync) if owner else sync), async_


def add_deprecated_aliases(cls: type) -> None:
    """Give ``cls`` every :data:`DEPRECATED` name, warning and calling the new one."""
    for old, new in DEPRECATED.items():
        setattr(cls, old, _alias(cls, old, new))


def _alias(cls: type, old: str, new: str) -> Callable:
    target = getattr(cls, new)

    def warn() -> None:
        warnings.warn(
            f"VLLMService.{old} is deprecated and will be removed in the next release; use "
            f"{new} (same arguments, same result).",
            DeprecationWarning,
            stacklevel=3,
        )

    if asyncio.iscoroutinefunction(target):

        async def alias(self, *args, **kwargs):
            warn()
            return await getattr(self, new)(*args, **kwargs)

    else:

        def alias(self, *args, **kwargs):
            warn()
            return getattr(self, new)(*args, **kwargs)

    alias.__name__ = old
    alias.__doc__ = f"Deprecated name of :meth:`{new}`."
    return alias


def close_at_exit(svc) -> None:
    """Shut the owner ``svc`` down when this process exits, if nothing did before.

    If Ray was shut down first (TorchRL's GRPO scripts call ``ray.shutdown()`` in a
    ``finally`` and never shut the engine down), its replicas were killed with it: only
    their temporary directories are left to remove. Holds ``svc`` weakly.
    """
    atexit.register(_close_at_exit, weakref.ref(svc))


def _close_at_exit(ref: weakref.ref) -> None:
    import ray

    svc = ref()
    if svc is None or svc.closed:
        return
    if ray.is_initialized():
        svc.shutdown()
    else:
        svc.close_after_ray()


__all__ = [
    "DEPRECATED",
    "FORWARDED",
    "add_deprecated_aliases",
    "close_at_exit",
    "delegate",
    "delegate_sync_and_async",
    "owner_only",
    "sync_and_async",
]
