"""Load-balancing strategies: pure functions from replica loads to an assignment.

A strategy looks at the whole batch and returns, for each prompt, a replica id or
``None`` ("no opinion"). :func:`route` applies the strategies in order, each one
filling what the previous ones left open, and round-robin settles the rest, so a
list of strategies is a fallback chain.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torchrl_vllm_ext.engine.sessions import SessionMap
from torchrl_vllm_ext.errors import UnknownRoutingStrategyError


@dataclass(frozen=True)
class ReplicaLoad:
    """What the router knows about one replica when a batch arrives."""

    replica_id: int
    """Stable id of the replica."""
    outstanding: int
    """Prompts sent to it and not yet returned."""
    kv_cache_usage: float | None = None
    """Fraction of its KV cache in use, as vLLM's scheduler last reported; None if unknown."""
    kv_capacity_tokens: int | None = None
    """Tokens its KV cache holds; None if unknown."""


@dataclass
class RouterState:
    """Mutable state kept between batches."""

    cursor: int = 0
    """Next position of the round-robin cycle."""
    sessions: SessionMap = field(default_factory=SessionMap)
    """Who served which sequences (the ``session`` strategy; the service records them)."""


@dataclass(frozen=True)
class RoutingRequest:
    """The batch as the router sees it."""

    prompts: Sequence[Sequence[int]]
    """Token ids of each prompt."""
    expected_tokens: Sequence[int] = field(default_factory=tuple)
    """Per prompt, the KV-cache tokens it will hold (prompt + max new tokens x n)."""


Assignment = list[int | None]
Strategy = Callable[[RoutingRequest, Sequence[ReplicaLoad], RouterState, Assignment], Assignment]

PREFIX_TOKENS = 32
"""Prefix-aware routing hashes at most this many leading tokens."""
MIN_PREFIX_TOKENS = 4
"""Prompts shorter than this carry too little prefix to route on."""
PREFIX_IMBALANCE = 1.5
"""Prefix routing yields (leaves None) rather than load a replica beyond this times the mean."""


def prefix_hash(tokens: Sequence[int], n: int = PREFIX_TOKENS) -> bytes:
    """A digest of the first ``n`` token ids, identical in every process and run.

    Python's ``hash()`` is salted per process, so a stable digest of the ids' bytes
    is used instead.
    """
    head = ",".join(str(int(t)) for t in tokens[:n])
    return hashlib.blake2b(head.encode(), digest_size=16).digest()


def _rendezvous(digest: bytes, replica_ids: Sequence[int]) -> int:
    # Highest-random-weight hashing: adding or removing one replica only moves the
    # prefixes that hashed to it, so the others keep their prefix-cache hits.
    def score(rid: int) -> bytes:
        return hashlib.blake2b(digest + rid.to_bytes(8, "little"), digest_size=8).digest()

    return max(replica_ids, key=score)


def _projected_loads(loads: Sequence[ReplicaLoad], assigned: Assignment) -> dict[int, int]:
    projected = {load.replica_id: load.outstanding for load in loads}
    for rid in assigned:
        if rid is not None:
            projected[rid] += 1
    return projected


def prefix_aware(req, loads, state, assigned):
    """Send prompts with the same leading tokens to the same replica (prefix-cache hits).

    Yields a prompt (leaves None) when it is too short or when its replica would
    be loaded beyond ``PREFIX_IMBALANCE`` times the mean.
    """
    out = list(assigned)
    ids = [load.replica_id for load in loads]
    projected = _projected_loads(loads, out)
    # The cap uses the load once the whole batch is placed, so the first prompts of a
    # batch are judged like the last ones.
    final_total = sum(load.outstanding for load in loads) + len(req.prompts)
    cap = PREFIX_IMBALANCE * final_total / len(ids) + 1
    for i, prompt in enumerate(req.prompts):
        if out[i] is not None or len(prompt) < MIN_PREFIX_TOKENS:
            continue
        rid = _rendezvous(prefix_hash(prompt), ids)
        if projected[rid] + 1 > cap:
            continue
        out[i] = rid
        projected[rid] += 1
    return out


def session_sticky(req, loads, state, assigned):
    """Send a prompt that continues a served sequence (the next turn of a chat) to the
    replica that served it, whose prefix cache holds it; yields (leaves None) when that
    replica is gone or would be loaded beyond ``PREFIX_IMBALANCE`` times the mean."""
    out = list(assigned)
    projected = _projected_loads(loads, out)
    final_total = sum(load.outstanding for load in loads) + len(req.prompts)
    cap = PREFIX_IMBALANCE * final_total / len(loads) + 1
    for i, prompt in enumerate(req.prompts):
        if out[i] is not None:
            continue
        rid = state.sessions.lookup(prompt)
        if rid is None or rid not in projected or projected[rid] + 1 > cap:
            continue
        out[i] = rid
        projected[rid] += 1
    return out


def least_outstanding(req, loads, state, assigned):
    """Each prompt goes to the replica with the fewest prompts in flight, counting this batch."""
    out = list(assigned)
    projected = _projected_loads(loads, out)
    order = [load.replica_id for load in loads]
    # Rotate tie-breaking so equal loads do not always favour the first replica.
    offset = state.cursor % len(order)
    order = order[offset:] + order[:offset]
    for i in range(len(req.prompts)):
        if out[i] is None:
            rid = min(order, key=lambda r: projected[r])
            out[i] = rid
            projected[rid] += 1
    state.cursor += 1
    return out


def kv_cache_usage(req, loads, state, assigned):
    """Each prompt goes to the replica whose KV cache would be least full after taking it.

    Uses vLLM's reported usage plus the tokens this batch already placed there; it has
    no opinion (all None) while any replica's usage or capacity is unknown.
    """
    out = list(assigned)
    if any(ld.kv_cache_usage is None or not ld.kv_capacity_tokens for ld in loads):
        return out
    usage = {ld.replica_id: ld.kv_cache_usage for ld in loads}
    capacity = {ld.replica_id: ld.kv_capacity_tokens for ld in loads}
    expected = list(req.expected_tokens) or [len(p) for p in req.prompts]
    for i, rid in enumerate(out):
        if rid is not None:
            usage[rid] += expected[i] / capacity[rid]
    for i in range(len(req.prompts)):
        if out[i] is None:
            rid = min(usage, key=lambda r: (usage[r], r))
            out[i] = rid
            usage[rid] += expected[i] / capacity[rid]
    return out


def round_robin(req, loads, state, assigned):
    """Cycle through the replicas, continuing where the previous batch stopped."""
    out = list(assigned)
    ids = [load.replica_id for load in loads]
    for i in range(len(out)):
        if out[i] is None:
            out[i] = ids[state.cursor % len(ids)]
            state.cursor += 1
    return out


STRATEGIES: dict[str, Strategy] = {
    "session": session_sticky,
    "prefix": prefix_aware,
    "least_outstanding": least_outstanding,
    "kv_cache": kv_cache_usage,
    "round_robin": round_robin,
}


def validate_strategies(strategies: str | Sequence[str]) -> tuple[str, ...]:
    """Normalise a strategy name or list of names; raise on an unknown one."""
    names = (strategies,) if isinstance(strategies, str) else tuple(strategies)
    if not names:
        raise UnknownRoutingStrategyError(
            f"routing={strategies!r} is empty; give one or more of {sorted(STRATEGIES)}."
        )
    for name in names:
        if name not in STRATEGIES:
            raise UnknownRoutingStrategyError(
                f"Unknown routing strategy {name!r}; use one of {sorted(STRATEGIES)} "
                "or a list of them (tried in order)."
            )
    return names


def route(
    req: RoutingRequest,
    loads: Sequence[ReplicaLoad],
    strategies: Sequence[str],
    state: RouterState,
) -> list[int]:
    """Assign every prompt of ``req`` to one of ``loads``' replicas.

    Examples:
        >>> loads = [ReplicaLoad(0, outstanding=3), ReplicaLoad(1, outstanding=0)]
        >>> route(RoutingRequest([[1, 2], [3, 4]]), loads, ["least_outstanding"], RouterState())
        [1, 1]
    """
    if not loads:
        raise ValueError("route() needs at least one replica")
    assigned: Assignment = [None] * len(req.prompts)
    for name in validate_strategies(strategies):
        assigned = STRATEGIES[name](req, loads, state, assigned)
        if all(a is not None for a in assigned):
            break
    if any(a is None for a in assigned):
        assigned = round_robin(req, loads, state, assigned)
    return [int(a) for a in assigned]
