"""The service's generation path: validate a batch, route it, send one call per replica,
retry a dead replica's share on the others, merge the results in input order.

A client of the :class:`~torchrl_vllm_ext.engine.driver.pool.ReplicaPool`: it reads the ready
snapshot, counts requests in flight with the pool's leases, and calls replicas through
the pool, whose death policy records and restarts a replica that dies; this module only
re-sends the dead replica's share.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from torchrl_vllm_ext.batches import PromptBatch, RequestBatch
from torchrl_vllm_ext.engine.adapters import AdapterRegistry
from torchrl_vllm_ext.engine.driver.pool import ReplicaPool
from torchrl_vllm_ext.engine.fleet import ReplicaView
from torchrl_vllm_ext.engine.routing import (
    ReplicaLoad,
    RouterState,
    RoutingRequest,
    route,
    validate_strategies,
)
from torchrl_vllm_ext.engine.validation import (
    check_prompts,
    expected_kv_tokens,
    make_sampling_params,
    normalize_prompts,
)
from torchrl_vllm_ext.errors import InvalidRequestError, ReplicaDeadError
from torchrl_vllm_ext.messages import ReplicaStats

logger = logging.getLogger(__name__)


class Generation:
    """Validate, route, send, retry and merge one batch over a :class:`ReplicaPool`.

    Args:
        pool: the replicas.
        adapters: the LoRA adapters the replicas serve (a request names one).
        name: prefix of request ids.

    Examples:
        >>> from torchrl_vllm_ext.engine.config import ServiceConfig
        >>> from torchrl_vllm_ext.testing import make_tiny_model
        >>> pool = ReplicaPool(ServiceConfig(model=make_tiny_model()), "svc")
        >>> gen = Generation(pool, AdapterRegistry(), "svc")
        >>> gen.routing
        ('session', 'prefix', 'least_outstanding')
    """

    def __init__(self, pool: ReplicaPool, adapters: AdapterRegistry, name: str):
        self._pool = pool
        self._adapters = adapters
        self._name = name
        self.routing = pool.config.routing  # checked by ServiceConfig
        self._router_state = RouterState()
        self._batches = itertools.count()
        pool.on_death(self._router_state.sessions.forget)  # its prefix cache is gone

    async def run(
        self,
        prompt_token_ids,
        sampling_params=None,
        timeout=None,
        routing=None,
        lora=None,
        return_log_probs: bool = True,
        seeds=None,
    ) -> RequestBatch:
        """One batch, on the service's event loop; a :class:`RequestBatch` in input order.

        ``return_log_probs=False``: vLLM does not compute the sampled tokens' log-probs
        (``RequestBatch.has_logprobs`` is False; the arrays hold NaN). ``seeds``: an int per
        prompt (the policy's), sent as one array with one ``SamplingParams``.
        """
        prompts = normalize_prompts(prompt_token_ids)
        adapter = self._adapters.get(lora) if lora is not None else None
        if seeds is not None:
            base, per_prompt = sampling_params, None
            seeds = np.asarray(seeds, dtype=np.int64).reshape(-1)
            if len(seeds) != len(prompts):
                raise InvalidRequestError(
                    f"{len(seeds)} seeds for {len(prompts)} prompts; give one int per prompt."
                )
        else:
            base, seeds, per_prompt = split_seeds(sampling_params, len(prompts))
        if per_prompt is not None:
            params = [make_sampling_params(p, want_logprobs=return_log_probs) for p in per_prompt]
        else:
            params = [make_sampling_params(base, want_logprobs=return_log_probs)] * len(prompts)
        return await self._routed(
            prompts, params, per_prompt is not None, seeds, timeout, routing, adapter
        )

    async def _routed(
        self, prompts, params, per_prompt: bool, seeds, timeout, routing, adapter
    ) -> RequestBatch:
        """Validate, route, send, re-send what a dead replica lost, merge."""
        await self._pool.wait_ready()
        limits = self._pool.limits
        check_prompts(prompts, limits.max_token_id, limits.max_model_len)
        strategies = validate_strategies(routing) if routing is not None else self.routing
        expected = expected_kv_tokens(prompts, params, limits.max_model_len)
        batch = next(self._batches)

        parts: list[tuple[list[int], RequestBatch]] = []
        pending = list(range(len(prompts)))
        max_retries = self._pool.config.max_retries
        for attempt in range(max_retries + 1):
            live = await self._pool.wait_ready()
            if len(live) == 1:  # nothing to choose: skip the prefix hashes and stats calls
                assignment = [live[0].replica_id] * len(pending)
            else:
                loads = await self._loads(live, strategies)
                assignment = route(
                    RoutingRequest([prompts[i] for i in pending], [expected[i] for i in pending]),
                    loads,
                    strategies,
                    self._router_state,
                )
            views = {v.replica_id: v for v in live}
            groups: dict[int, list[int]] = {}
            for idx, rid in zip(pending, assignment, strict=True):
                groups.setdefault(rid, []).append(idx)
            sends = [
                self._send(
                    views[rid],
                    idxs,
                    prompts,
                    params,
                    per_prompt,
                    seeds,
                    timeout,
                    f"{self._name}-b{batch}-a{attempt}",
                    adapter,
                )
                for rid, idxs in groups.items()
            ]
            outcomes = await asyncio.gather(*sends, return_exceptions=True)
            failed, error = [], None
            for idxs, outcome in zip(groups.values(), outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    if isinstance(outcome, ReplicaDeadError):  # recorded by the pool
                        failed.extend(idxs)
                    elif error is None:
                        error = outcome
                else:
                    parts.append((idxs, outcome))
            if error is not None:
                raise error
            if not failed:
                if "session" in strategies and len(live) > 1:  # next turns go where these ran
                    for _, part in parts:
                        self._router_state.sessions.record_batch(part)
                return RequestBatch.merge(parts, len(prompts))
            pending = sorted(failed)
            logger.warning(
                "batch %d: %d prompts lost a replica; retrying on the others", batch, len(pending)
            )
        raise ReplicaDeadError(
            f"batch {batch}: {len(pending)} prompts failed on a dead replica {max_retries + 1} "
            "times; check the replicas' logs (out of memory?) or raise max_retries."
        )

    async def _send(
        self, rep: ReplicaView, idxs, prompts, params, per_prompt, seeds, timeout, prefix, adapter
    ):
        requests = PromptBatch.of(
            [prompts[i] for i in idxs],
            prefix,
            idxs,
            seeds=None if seeds is None else seeds[idxs],
        )
        sp = [params[i] for i in idxs] if per_prompt else params[0]
        async with self._pool.lease(rep.replica_id, len(idxs)):
            return await self._pool.call(rep, "generate", requests, sp, timeout, adapter)

    async def _loads(self, live: tuple[ReplicaView, ...], strategies) -> list[ReplicaLoad]:
        kv: dict[int, ReplicaStats] = {}
        if "kv_cache" in strategies:
            stats = await self._pool.call_all("stats", replicas=live)
            kv = stats.results
            for rid, error in {**stats.errors, **stats.dead}.items():
                # Unknown usage: the kv_cache strategy then defers to the next strategy.
                logger.debug("no stats from replica %d: %s", rid, error)
        return [
            ReplicaLoad(
                replica_id=r.replica_id,
                outstanding=self._pool.inflight(r.replica_id),
                kv_cache_usage=kv[r.replica_id].kv_cache_usage if r.replica_id in kv else None,
                kv_capacity_tokens=r.info.kv_capacity_tokens,
            )
            for r in live
        ]


def split_seeds(sampling_params, n: int) -> tuple[Any, np.ndarray | None, list | None]:
    """``(one params, seeds array or None, None)`` when the prompts share their sampling
    parameters but for the seed (the policy's per-element seeds), so one ``SamplingParams``
    and an int array cross Ray; else ``(None, None, one params per prompt)``.

    Examples:
        >>> base, seeds, per = split_seeds([{"max_tokens": 4, "seed": s} for s in (7, 8)], 2)
        >>> base, seeds.tolist(), per
        ({'max_tokens': 4}, [7, 8], None)
        >>> split_seeds({"max_tokens": 4}, 3)
        ({'max_tokens': 4}, None, None)
        >>> split_seeds([{"max_tokens": 4}, {"max_tokens": 5}], 2)[2]
        [{'max_tokens': 4}, {'max_tokens': 5}]
    """
    if not isinstance(sampling_params, list | tuple):
        return sampling_params, None, None
    if len(sampling_params) != n:
        raise InvalidRequestError(
            f"{len(sampling_params)} sampling params for {n} prompts; "
            "pass one per prompt or a single one."
        )
    if n and all(isinstance(p, Mapping) for p in sampling_params):
        bases = [{k: v for k, v in p.items() if k != "seed"} for p in sampling_params]
        seeds = [p.get("seed") for p in sampling_params]
        if all(b == bases[0] for b in bases) and all(isinstance(s, int) for s in seeds):
            return bases[0], np.asarray(seeds, dtype=np.int64), None
    return None, None, list(sampling_params)


__all__ = ["Generation", "split_seeds"]
