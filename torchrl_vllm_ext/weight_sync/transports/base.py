"""The transport protocol: how a push's bytes reach the replicas' workers.

A push (``WeightSyncScheme``) is: validate -> ``prepare`` (outside any pause: write,
send, stage; the replicas keep generating) -> on each replica, in its pause, the
:class:`WorkerCall` ``prepare`` returned -> ``commit`` (or ``rollback`` when no replica
loaded). ``bring_up`` loads the last committed version into a restarted replica.
Everything runs on the service's event loop; blocking work goes to a thread.

To add a transport: subclass :class:`Transport`, name the worker-extension methods it
calls in :mod:`torchrl_vllm_ext.protocol` (and add them to the worker extension), and
register it in :func:`~torchrl_vllm_ext.weight_sync.transports.make_transport`.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from torchrl_vllm_ext.engine.cluster import DEATH_ERRORS, actor_cause
from torchrl_vllm_ext.errors import WeightSyncError

logger = logging.getLogger(__name__)

Replicas = list[tuple[int, Any]]
"""``(replica id, Ray actor handle)`` of the replicas a push reaches."""


@dataclass(frozen=True)
class WorkerCall:
    """The worker-extension call a replica makes inside its pause (plain-data arguments)."""

    method: str
    """A :class:`~torchrl_vllm_ext.protocol.WorkerMethods` name."""
    args: tuple = ()
    """Its positional arguments."""


@dataclass
class Outcomes:
    """Results of one call per replica, by replica id."""

    results: dict[int, Any] = field(default_factory=dict)
    """Replicas that answered, and what."""
    dead: list[int] = field(default_factory=list)
    """Replicas that died meanwhile (the service restarts them)."""
    errors: dict[int, BaseException] = field(default_factory=dict)
    """Replicas whose call failed, and why."""


async def fan_out(replicas: Replicas, call: Callable[[Any], Any], what: str) -> Outcomes:
    """Run ``call(handle)`` (a Ray object ref) on every replica at once; every outcome.

    Never stops at the first failure: the caller sees which replicas did what.
    """
    refs = [call(handle) for _, handle in replicas]
    answers = await asyncio.gather(*refs, return_exceptions=True)
    out = Outcomes()
    for (rid, _), answer in zip(replicas, answers, strict=True):
        if isinstance(answer, DEATH_ERRORS):
            logger.warning("replica %d died during %s (%s)", rid, what, type(answer).__name__)
            out.dead.append(rid)
        elif isinstance(answer, BaseException):
            out.errors[rid] = answer
        else:
            out.results[rid] = answer
    return out


def first_error(outcomes: Outcomes) -> tuple[int, BaseException, BaseException]:
    """The first failed replica: its id, the error, and the replica-side cause inside it."""
    rid, error = next(iter(outcomes.errors.items()))
    return rid, error, actor_cause(error)


def raise_errors(outcomes: Outcomes, what: str, version: str) -> None:
    """A :class:`WeightSyncError` naming the first failed replica, if any failed."""
    if outcomes.errors:
        rid, error, cause = first_error(outcomes)
        raise WeightSyncError(
            f"{what} of version {version} failed on replica {rid}: {cause}"
        ) from error


class Transport(abc.ABC):
    """Moves validated weights to the replicas' workers; one per scheme.

    Examples:
        >>> class Noop(Transport):  # the smallest transport: the workers reload the checkpoint
        ...     name = "noop"
        ...     async def prepare(self, tensors, version, replicas, phases):
        ...         return WorkerCall("reload_checkpoint", (version,))  # a worker-extension method
        ...     async def bring_up(self, handle, version):
        ...         await handle.collective_rpc.remote("reload_checkpoint", (version,))
    """

    name: ClassVar[str]
    """``storage`` or ``broadcast`` (reported in ``SyncReport.transport``)."""
    checks_finite: ClassVar[bool] = False
    """Whether :meth:`prepare` rejects non-finite tensors itself (in its copy pass),
    so the scheme's validation can skip that pass."""
    survives_replica_loss: ClassVar[bool] = True
    """Whether a push can go on when a replica dies during it (a collective cannot)."""
    loads_one_at_a_time: ClassVar[bool] = True
    """Whether replicas can load one after the other (``rollout="rolling"``)."""

    def __init__(self, service):
        self.service = service

    @abc.abstractmethod
    async def prepare(
        self, tensors: dict[str, torch.Tensor], version: str, replicas: Replicas, phases: dict
    ) -> WorkerCall:
        """Outside the pause: get ``tensors`` to the replicas; return the load call.

        Drops replicas that died from ``replicas`` (in place) where it can go on without
        them; records its phase timings (seconds) in ``phases``. Raises
        :class:`WeightSyncError` if no replica can load.
        """

    async def commit(self, version: str) -> None:
        """Every replica (or, for a partial failure, some replica) now serves ``version``."""
        return None

    async def rollback(self, version: str) -> None:
        """No replica loaded ``version``: restore what restarted replicas will load."""
        return None

    @abc.abstractmethod
    async def bring_up(self, handle, version: str) -> None:
        """Load the committed ``version`` into a restarted replica's workers."""

    def close(self) -> None:
        """Release what the transport holds (groups, mappings)."""
        return None
