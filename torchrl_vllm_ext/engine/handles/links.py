"""The service's two sides across processes: the owner's link to its directory and a
handle's (see :mod:`.directory` for what crosses, and :mod:`.owner` for who may do what).

* :class:`OwnerLink` (the process that launched the service): starts the directory actor
  and the mailbox, publishes the pool's table after every change, reserves the master
  port, and holds the callables the owner exports to its handles (a weight-sync
  updater's push), weakly.
* :class:`HandleLink` (a pickled service): forwards owner-only calls and waits for the
  owner's answer.
* :func:`attach`: what unpickling a service runs.
"""

from __future__ import annotations

import itertools
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import ray

from torchrl_vllm_ext.engine.calls import actor_cause
from torchrl_vllm_ext.engine.handles import directory
from torchrl_vllm_ext.engine.handles.owner import FORWARDED
from torchrl_vllm_ext.engine.handles.pool import HandlePool
from torchrl_vllm_ext.engine.handles.ports import PortReservation
from torchrl_vllm_ext.errors import ConfigurationError, InvalidRequestError, ServiceClosedError


class OwnerLink:
    """The owner's directory, mailbox, reserved port and exports.

    Args:
        name: the service's name.
        serve: ``serve(kind, payload)``: the owner's answer to a handle's request.
    """

    def __init__(self, name: str, serve: Callable[[str, Any], Any]):
        # On this node's Ray address (TorchRL's master address), not every interface.
        self.port = PortReservation(ray.util.get_node_ip_address())
        self.directory = directory.start_directory(name)
        self._seq = itertools.count(1)
        self._exports: dict[str, weakref.WeakMethod] = {}
        self._mailbox = directory.Mailbox(self.directory, serve, name)

    def table(self, pool, adapters, closed: bool = False) -> directory.ReplicaTable:
        """The pool's state now, as plain data and actor handles."""
        return directory.ReplicaTable(
            seq=next(self._seq),
            ready=pool.ready(),
            states={rid: s.value for rid, s in pool.states().items()},
            weight_version=pool.weight_version,
            deaths=tuple(pool.deaths()),
            limits=pool.limits,
            adapters=tuple(adapters),
            uses_gpu=pool.uses_gpu,
            closed=closed,
        )

    def publish(self, pool, adapters, closed: bool = False) -> None:
        """Send the table to the directory (no wait: Ray keeps one caller's calls in order)."""
        self.directory.publish.remote(self.table(pool, adapters, closed))

    def export(self, method: Callable) -> str:
        """A key a handle calls the bound ``method`` by (held weakly: closing its object
        ends the export)."""
        key = uuid.uuid4().hex
        self._exports[key] = weakref.WeakMethod(method)
        return key

    def exported(self, key: str) -> Callable:
        ref = self._exports.get(key)
        method = ref() if ref is not None else None
        if method is None:
            raise ConfigurationError(
                f"export {key[:8]} of this service is gone (its object was closed or freed "
                "on the owner); ship a new one from the owner."
            )
        return method

    def close(self, pool, adapters) -> None:
        """Tell the handles the service is closed; stop the mailbox and the directory."""
        try:
            self.publish(pool, adapters, closed=True)
        finally:
            self._mailbox.close()
            ray.kill(self.directory)
            self.port.close()


class HandleLink:
    """A handle's way to its owner: forwarded calls through the directory's mailbox."""

    def __init__(self, directory_actor, name: str, caught_up: Callable[[Any], None]):
        self.directory = directory_actor
        self._name = name
        self._caught_up = caught_up

    def forward(self, name: str, args: tuple, kwargs: dict) -> Any:
        """Owner-only method ``name`` run by the owner; its answer or its error."""
        if name == "update_weights":  # an iterator crosses as the list it yields
            args = (list(args[0]), *args[1:])
        try:
            # In the object store, by reference: the directory only passes it on.
            call = [ray.put((name, args, kwargs))]
            request = ray.get(self.directory.submit.remote("call", call))
            answer, table = ray.get(self.directory.result.remote(request))
            # Read your writes: the table the call left (a push's version), taken now, not
            # at the watcher's next poll (one round trip with the answer).
            self._caught_up(table)
            return answer
        except ray.exceptions.RayTaskError as e:
            raise actor_cause(e) from None
        except ray.exceptions.RayActorError as e:
            raise ServiceClosedError(
                f"service {self._name}: its owner shut it down or exited ({e})."
            ) from e


def serve(service, kind: str, payload) -> Any:
    """The owner's answer to a handle's request (on a mailbox thread): a death it saw goes
    to the pool's death policy; a forwarded call runs if it is :data:`~.owner.FORWARDED`."""
    if kind == "death":
        return service.run(service.pool.report_death(*payload))
    name, args, kwargs = ray.get(payload[0]) if kind == "call" else (kind, (), {})
    if name not in FORWARDED:
        raise InvalidRequestError(f"a service handle asked for {kind} {name!r}: not served.")
    return getattr(service, name)(*args, **kwargs)


def attach(cls: type, config, directory_actor, table, owner: str):
    """A handle to a running service, in this process (what unpickling a service runs)."""
    pool = HandlePool(config, directory_actor, table)
    # A name of its own: request ids stay unique per engine.
    svc = cls(config, pool, name=f"{owner}-h{uuid.uuid4().hex[:4]}")
    link = HandleLink(directory_actor, owner, lambda newer: svc.run(_apply(pool, newer)))
    svc.follow(link, table.adapters)
    svc.run(_watch(pool))
    return svc


async def _watch(pool: HandlePool) -> None:
    pool.start_watching()


async def _apply(pool: HandlePool, table) -> None:
    pool.apply(table)


__all__ = ["HandleLink", "OwnerLink", "attach", "serve"]
