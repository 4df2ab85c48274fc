"""One fan-out to replica actors and how each outcome is sorted, shared by the service's
pool and the pool view of a service handle in another process.

The caller gives ``died(view, error, what)``: what to do when a replica is found dead
(the pool records and restarts it; a handle reports it to the owner). Everything else
(answers, replica-side errors, deadlines) is sorted here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import ray

from torchrl_vllm_ext.errors import ReplicaDeadError

DEATH_ERRORS = (
    ray.exceptions.RayActorError,
    ray.exceptions.ActorUnavailableError,
    ReplicaDeadError,
)
"""What a call to a replica actor raises when the replica (or its engine) is gone."""


def actor_cause(error: BaseException) -> BaseException:
    """The exception an actor method raised, out of Ray's ``RayTaskError`` wrapper."""
    if isinstance(error, ray.exceptions.RayTaskError) and error.cause is not None:
        return error.cause
    return error


Died = Callable[[Any, BaseException, str], ReplicaDeadError]
"""``died(view, error, what)``: apply a death policy to ``view``'s replica; the caller's error."""


class Unresponsive(Exception):
    """A replica gave no answer within a call's deadline: it is handled as dead."""


@dataclass
class Outcomes:
    """One call per replica, every outcome by replica id (nothing stops at a failure)."""

    results: dict[int, Any] = field(default_factory=dict)
    """Replicas that answered, and what."""
    errors: dict[int, BaseException] = field(default_factory=dict)
    """Replicas whose call raised, with the replica-side exception (out of Ray's wrapper)."""
    dead: dict[int, ReplicaDeadError] = field(default_factory=dict)
    """Replicas that died meanwhile (recorded and being restarted by the pool)."""

    def check(self, what: str) -> None:
        """Raise the first replica's error, or :class:`ReplicaDeadError` when every
        replica called died; return when the others answered."""
        if self.errors:
            raise next(iter(self.errors.values()))
        if self.dead and not self.results:
            raise ReplicaDeadError(
                f"{what}: every replica called died ({sorted(self.dead)}); they are being "
                "restarted, try again once they serve."
            )


async def call_each(
    targets: Iterable[Any],
    call: Callable[[Any], Awaitable[Any]],
    died: Died,
    what: str = "call",
    timeout: float | None = None,
    deadline: float | None = None,
) -> Outcomes:
    """Await ``call(view)`` on every target at once; every outcome, ``died`` applied to
    the dead. ``timeout``: a late answer is an error; ``deadline``: a late replica is dead."""
    targets = tuple(targets)
    limits = [t for t in (timeout, deadline) if t is not None]
    limit = min(limits) if limits else None

    async def one(view):
        try:
            return await asyncio.wait_for(call(view), limit)
        except TimeoutError as e:
            if deadline is not None and limit == deadline:
                raise Unresponsive(
                    f"no answer to {what} within its deadline of {deadline:.1f}s"
                ) from e
            raise

    answers = await asyncio.gather(*(one(v) for v in targets), return_exceptions=True)
    out = Outcomes()
    for view, answer in zip(targets, answers, strict=True):
        if isinstance(answer, (*DEATH_ERRORS, Unresponsive)):
            out.dead[view.replica_id] = died(view, answer, what)
        elif isinstance(answer, BaseException):
            out.errors[view.replica_id] = actor_cause(answer)
        else:
            out.results[view.replica_id] = answer
    return out


async def call_one(view: Any, method: str, args: tuple, died: Died) -> Any:
    """``method(*args)`` on one replica: its answer, the replica-side exception, or the
    :class:`ReplicaDeadError` ``died`` returns."""
    try:
        return await getattr(view.handle, method).remote(*args)
    except DEATH_ERRORS as e:
        raise died(view, e, method) from e
    except ray.exceptions.RayTaskError as e:
        raise actor_cause(e) from None


class ReplicaCalls:
    """The fan-out methods of a pool (the owner's and a handle's), over its
    ``ready()`` replicas and its ``_died(view, error, what)`` death policy."""

    def ready(self) -> tuple:
        raise NotImplementedError

    def _died(self, view: Any, error: BaseException, what: str) -> ReplicaDeadError:
        raise NotImplementedError

    async def call_each(
        self,
        call: Callable[[Any], Awaitable[Any]],
        replicas: Iterable[Any] | None = None,
        what: str = "call",
        timeout: float | None = None,
        deadline: float | None = None,
    ) -> Outcomes:
        """Await ``call(replica)`` on every ready replica (or ``replicas``) at once;
        every outcome, with the death policy applied.

        ``timeout``: seconds after which a replica's call is given up, reported in
        ``errors`` (the replica may just be busy). ``deadline``: seconds after which a
        replica that has not answered counts as gone (``dead``): it is killed and
        restarted like a replica that died.
        """
        targets = self.ready() if replicas is None else replicas
        return await call_each(targets, call, self._died, what, timeout, deadline)

    async def call_all(
        self,
        method: str,
        *args: Any,
        replicas: Iterable[Any] | None = None,
        timeout: float | None = None,
        deadline: float | None = None,
    ) -> Outcomes:
        """The replica actor's ``method(*args)`` on every ready replica (or ``replicas``);
        ``timeout`` and ``deadline`` as in :meth:`call_each`."""
        return await self.call_each(
            lambda v: getattr(v.handle, method).remote(*args), replicas, method, timeout, deadline
        )

    async def call(self, replica: Any, method: str, *args: Any) -> Any:
        """``method(*args)`` on one replica: its answer, the replica-side exception, or
        :class:`ReplicaDeadError` if it died (as the pool's death policy says)."""
        return await call_one(replica, method, args, self._died)


__all__ = ["Outcomes", "ReplicaCalls", "Unresponsive", "call_each", "call_one"]
