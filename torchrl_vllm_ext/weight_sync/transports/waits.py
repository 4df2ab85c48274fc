"""What the senders wait for on the replicas, written once: every worker staged a version
(:func:`wait_staged`, polling ``STAGED_READY``), and the replicas released what a closing
transport shared with them (:func:`release_on_replicas`, :func:`wait_for_answers`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from torchrl_vllm_ext.engine.calls import Outcomes
from torchrl_vllm_ext.engine.fleet import ReplicaFleet, ReplicaView
from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.extensions import WorkerMethods
from torchrl_vllm_ext.weight_sync.transports.protocol import Replicas, raise_errors

logger = logging.getLogger(__name__)

STAGED_POLL_S = 0.005
"""Seconds between checks that every worker finished staging a version."""

SENDING_POLL_S = 0.25
"""Seconds between the same checks while the trainer still sends the bytes (a heartbeat:
a replica that stops answering them is found while the send still runs)."""

RELEASE_WAIT_S = 10.0
"""How long a closing transport waits for the replicas to release what it shared with
them (mappings of slots or buckets)."""


def fail_on_errors(outcomes: Outcomes, version: str) -> None:
    """:func:`wait_staged`'s default check of a poll: a replica whose staging failed fails
    the push; one that died or did not answer is left out (the death policy restarts it)."""
    raise_errors(outcomes, "stage", version)


async def wait_staged(
    fleet: ReplicaFleet,
    replicas: Replicas,
    version: str,
    limit_s: float,
    answer_s: float,
    check: Callable[[Outcomes, str], None] = fail_on_errors,
    sending: asyncio.Future | None = None,
) -> Replicas:
    """Poll the workers of ``replicas`` until each staged ``version`` (their background
    receive or copy); returns those that did.

    Args:
        fleet: the replicas' pool (each poll goes through its death policy).
        replicas: those to wait for.
        version: the version they stage.
        limit_s: how long the whole wait may take.
        answer_s: how long a replica may take to answer one poll (unanswered: dead).
        check: what each poll's outcomes must satisfy, ``(outcomes, version)``; raises to
            fail the push (broadcast: a replica that died fails it too, since a collective
            cannot lose a member). A replica it lets pass without an answer is left out.
        sending: the trainer's send of the bytes while it runs (broadcast): the wait ends
            only once it ended too, and at once if it failed (the caller reads its
            error); while it runs, a poll is a heartbeat every :data:`SENDING_POLL_S`,
            woken as soon as it ends.

    Raises:
        WeightSyncError: after ``limit_s`` seconds, naming the replicas still staging.
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    replicas = list(replicas)
    while replicas:
        ready = await fleet.call_all(
            "collective_rpc",
            WorkerMethods.STAGED_READY,
            (version,),
            replicas=replicas,
            deadline=answer_s,
        )
        check(ready, version)
        replicas = [r for r in replicas if r.replica_id in ready.results]
        staged = all(all(per_worker) for per_worker in ready.results.values())
        sent = sending is None or sending.done()
        if sent and (staged or (sending is not None and sending.exception() is not None)):
            return replicas
        if loop.time() > end:
            waiting = sorted(rid for rid, w in ready.results.items() if not all(w))
            raise WeightSyncError(
                f"replica(s) {waiting} did not stage version {version} within {limit_s:.1f}s; "
                "no replica loaded it. Push again, or raise the scheme's deadline (a slower "
                "network needs a lower min_bytes_per_s)."
            )
        if sent:
            await asyncio.sleep(STAGED_POLL_S)
        else:  # a heartbeat while sending, but wake as soon as the send ends
            await asyncio.wait({sending}, timeout=SENDING_POLL_S)
    return replicas


def wait_for_answers(refs: list, timeout_s: float, what: str) -> None:
    """Wait (at most ``timeout_s``) for replicas' answers to a release call and read each
    outcome: a replica that died or shut down meanwhile holds nothing any more, and a ref
    whose error is never read makes Ray log it as an "unhandled error" at exit (the
    service is often closed right after the scheme). ``what`` names the call in the debug
    log."""
    if not refs:
        return
    import ray

    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for ref in done:
        try:
            ray.get(ref)
        except Exception as e:
            logger.debug("a replica could not %s: %s", what, e)


def release_on_replicas(
    fleet: ReplicaFleet, calls: Callable[[ReplicaView], list], what: str
) -> None:
    """A closing transport's last step: ``calls(replica)`` (the Ray refs of its release
    calls) on every ready replica, then their answers read within :data:`RELEASE_WAIT_S`.
    ``what`` names the release in the debug log."""
    refs = []
    for r in fleet.ready():
        try:
            refs.extend(calls(r))
        except Exception:  # Ray already shut down: the replicas are gone with it
            logger.debug("could not ask replica %d to %s", r.replica_id, what)
    wait_for_answers(refs, RELEASE_WAIT_S, what)
