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
import logging
from dataclasses import dataclass
from typing import ClassVar

import torch

from torchrl_vllm_ext.engine.calls import Outcomes
from torchrl_vllm_ext.engine.fleet import ReplicaFleet, ReplicaView
from torchrl_vllm_ext.errors import WeightSyncError

logger = logging.getLogger(__name__)

Replicas = list[ReplicaView]
"""The replicas a push reaches (a transport drops those that died, in place)."""


@dataclass(frozen=True)
class WorkerCall:
    """The worker-extension call a replica makes inside its pause (plain-data arguments)."""

    method: str
    """A :class:`~torchrl_vllm_ext.protocol.WorkerMethods` name."""
    args: tuple = ()
    """Its positional arguments."""


def raise_errors(outcomes: Outcomes, what: str, version: str) -> None:
    """A :class:`WeightSyncError` naming the first failed replica, if any failed."""
    if outcomes.errors:
        rid, cause = next(iter(outcomes.errors.items()))
        raise WeightSyncError(
            f"{what} of version {version} failed on replica {rid}: {cause}"
        ) from cause


def settle(refs: list, timeout: float, what: str) -> None:
    """Wait (bounded) for replicas' answers to a release call and read each outcome: a
    replica that died or shut down meanwhile holds nothing any more, and a ref whose
    error is never read makes Ray log it as an "unhandled error" at exit (the service is
    often closed right after the scheme). ``what`` names the call in the debug log."""
    if not refs:
        return
    import ray

    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    for ref in done:
        try:
            ray.get(ref)
        except Exception as e:
            logger.debug("a replica could not %s: %s", what, e)


STAGED_POLL_S = 0.005
"""Seconds between checks that every worker finished staging a version."""


async def wait_staged(
    fleet: ReplicaFleet, replicas: Replicas, version: str, limit_s: float, answer_s: float
) -> None:
    """Poll the workers of ``replicas`` until each staged ``version`` (their background
    read); a replica that died or does not answer within ``answer_s`` is dropped from
    ``replicas`` (the death policy restarts it), one whose staging failed fails the push.
    Raises :class:`WeightSyncError` after ``limit_s`` seconds."""
    import asyncio

    from torchrl_vllm_ext.protocol import WorkerMethods

    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while replicas:
        ready = await fleet.call_all(
            "collective_rpc",
            WorkerMethods.STAGED_READY,
            (version,),
            replicas=replicas,
            deadline=answer_s,
        )
        raise_errors(ready, "stage", version)
        replicas[:] = [r for r in replicas if r.replica_id in ready.results]
        if all(all(per_worker) for per_worker in ready.results.values()):
            return
        if loop.time() > end:
            waiting = sorted(rid for rid, w in ready.results.items() if not all(w))
            raise WeightSyncError(
                f"replica(s) {waiting} did not stage version {version} within {limit_s:.1f}s; "
                "no replica loaded it. Push again, or raise the scheme's deadline."
            )
        await asyncio.sleep(STAGED_POLL_S)


class Transport(abc.ABC):
    """Moves validated weights to the replicas' workers; one per scheme.

    Examples:
        >>> class Noop(Transport):  # the smallest transport: the workers reload the checkpoint
        ...     name = "noop"
        ...     async def prepare(self, tensors, version, replicas, phases):
        ...         return WorkerCall("reload_checkpoint", (version,))  # a worker-extension method
        ...     async def bring_up(self, replica, version):
        ...         await replica.handle.collective_rpc.remote("reload_checkpoint", (version,))
    """

    name: ClassVar[str]
    """``storage`` or ``broadcast`` (reported in ``SyncReport.transport``)."""
    checks_finite: ClassVar[bool] = False
    """Whether :meth:`prepare` rejects non-finite tensors itself (in its copy pass),
    so the scheme's validation can skip that pass."""
    loads_one_at_a_time: ClassVar[bool] = True
    """Whether replicas can load one after the other (``rollout="rolling"``)."""

    def __init__(self, fleet: ReplicaFleet):
        self.fleet = fleet
        self.staged_in: dict[int, str] = {}
        """Where each replica staged the last push (``device`` / ``pinned`` on GPUs; empty
        where the transport stages nothing)."""

    @abc.abstractmethod
    async def prepare(
        self, tensors: dict[str, torch.Tensor], version: str, replicas: Replicas, phases: dict
    ) -> WorkerCall:
        """Outside the pause: get ``tensors`` to the replicas; return the load call.

        Drops replicas that died from ``replicas`` (in place) where it can go on without
        them; records its phase timings (seconds) in ``phases``. Raises
        :class:`WeightSyncError` if no replica can load.
        """

    async def connect(self, replicas: Replicas, nbytes: int) -> None:
        """Before the first push of ``nbytes``: set up what every push uses (a group)."""
        return None

    async def commit(self, version: str) -> None:
        """Every replica (or, for a partial failure, some replica) now serves ``version``."""
        return None

    async def rollback(self, version: str) -> None:
        """No replica loaded ``version``: restore what restarted replicas will load."""
        return None

    @abc.abstractmethod
    async def bring_up(self, replica: ReplicaView, version: str) -> None:
        """Load the committed ``version`` into a restarted replica's workers (it takes no
        traffic yet; call its handle directly)."""

    def close(self) -> None:
        """Release what the transport holds (groups, mappings)."""
        return None
