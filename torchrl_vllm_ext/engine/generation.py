"""The service's generation path: validate a batch, route it, send one call per replica,
retry a dead replica's share on the others, merge the results in input order.

A mixin of :class:`~torchrl_vllm_ext.engine.service.VLLMService` (its state: replicas,
router, adapters, event loop), kept apart because it is the hot path and the largest
concern of the service.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torchrl_vllm_ext.engine.cluster import DEATH_ERRORS
from torchrl_vllm_ext.engine.outputs import to_request_output
from torchrl_vllm_ext.engine.routing import (
    ReplicaLoad,
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
from torchrl_vllm_ext.errors import InvalidRequestError, NoHealthyReplicaError, ReplicaDeadError
from torchrl_vllm_ext.messages import ReplicaStats, RequestBatch, RequestData

if TYPE_CHECKING:
    from torchrl_vllm_ext.engine.service import _Replica

logger = logging.getLogger(__name__)


class BatchGeneration:
    """``generate`` / ``agenerate`` / ``*_batch`` / ``*_flat`` and what they share."""

    def generate(
        self,
        prompt_token_ids,
        sampling_params=None,
        *,
        timeout: float | None = None,
        routing: str | Sequence[str] | None = None,
        lora: str | None = None,
    ) -> list:
        """Generate for a batch of token-id prompts; vLLM ``RequestOutput``s in input order.

        Args:
            prompt_token_ids: a list of 1-D token-id sequences.
            sampling_params: a ``vllm.SamplingParams``, a dict of its fields, or a list
                with one per prompt. Sampled-token log-probs are always returned.
            timeout: seconds; on expiry the requests are aborted inside vLLM and
                :class:`~torchrl_vllm_ext.errors.GenerationTimeoutError` is raised.
            routing: override the service's routing strategies for this batch.
            lora: name of a LoRA adapter added with :meth:`add_lora` (None: base weights).
        """
        return self.run(
            self.agenerate(
                prompt_token_ids, sampling_params, timeout=timeout, routing=routing, lora=lora
            )
        )

    async def agenerate(
        self, prompt_token_ids, sampling_params=None, *, timeout=None, routing=None, lora=None
    ) -> list:
        """Async :meth:`generate`."""
        data = await self.agenerate_batch(
            prompt_token_ids, sampling_params, timeout=timeout, routing=routing, lora=lora
        )
        return [to_request_output(d, f"{self.name}-{i}") for i, d in enumerate(data)]

    def generate_batch(
        self, prompt_token_ids, sampling_params=None, *, timeout=None, routing=None, lora=None
    ) -> list[RequestData]:
        """Like :meth:`generate` but returns plain :class:`RequestData` (numpy arrays)."""
        return self.generate_flat(
            prompt_token_ids, sampling_params, timeout=timeout, routing=routing, lora=lora
        ).unpack()

    async def agenerate_batch(
        self, prompt_token_ids, sampling_params=None, *, timeout=None, routing=None, lora=None
    ) -> list[RequestData]:
        """Async :meth:`generate_batch`."""
        flat = await self.agenerate_flat(
            prompt_token_ids, sampling_params, timeout=timeout, routing=routing, lora=lora
        )
        return flat.unpack()

    def generate_flat(
        self, prompt_token_ids, sampling_params=None, *, timeout=None, routing=None, lora=None
    ) -> RequestBatch:
        """Like :meth:`generate` but returns one :class:`RequestBatch` of flat arrays, in
        input order: the fastest form, which ``VLLMPolicy`` converts to a TensorDict."""
        return self.run(self._generate(prompt_token_ids, sampling_params, timeout, routing, lora))

    async def agenerate_flat(
        self, prompt_token_ids, sampling_params=None, *, timeout=None, routing=None, lora=None
    ) -> RequestBatch:
        """Async :meth:`generate_flat`."""
        return await self.arun(
            self._generate(prompt_token_ids, sampling_params, timeout, routing, lora)
        )

    async def _generate(
        self, prompt_token_ids, sampling_params, timeout, routing, lora=None
    ) -> RequestBatch:
        prompts = normalize_prompts(prompt_token_ids)
        adapter = self._adapters.get(lora) if lora is not None else None
        per_prompt = isinstance(sampling_params, list | tuple)
        if per_prompt:
            if len(sampling_params) != len(prompts):
                raise InvalidRequestError(
                    f"{len(sampling_params)} sampling params for {len(prompts)} prompts; "
                    "pass one per prompt or a single one."
                )
            params = [make_sampling_params(p) for p in sampling_params]
        else:
            params = [make_sampling_params(sampling_params)] * len(prompts)
        await self._wait_for_ready()
        limits = self._limits
        check_prompts(prompts, limits.max_token_id, limits.max_model_len)
        strategies = validate_strategies(routing) if routing is not None else self._routing
        expected = expected_kv_tokens(prompts, params, limits.max_model_len)
        batch = next(self._batches)

        parts: list[tuple[list[int], RequestBatch]] = []
        pending = list(range(len(prompts)))
        for attempt in range(self.config.max_retries + 1):
            live = await self._wait_for_ready()
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
            groups: dict[int, list[int]] = {}
            for idx, rid in zip(pending, assignment, strict=True):
                groups.setdefault(rid, []).append(idx)
            sends = [
                self._send(
                    self._replicas[rid],
                    idxs,
                    prompts,
                    params,
                    per_prompt,
                    timeout,
                    f"{self.name}-b{batch}-a{attempt}",
                    adapter,
                )
                for rid, idxs in groups.items()
            ]
            outcomes = await asyncio.gather(*sends, return_exceptions=True)
            failed, error = [], None
            for (rid, idxs), outcome in zip(groups.items(), outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    if isinstance(outcome, DEATH_ERRORS):
                        self._on_replica_death(rid, outcome)
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
            f"batch {batch}: {len(pending)} prompts failed on a dead replica {self.config.max_retries + 1} "
            "times; check the replicas' logs (out of memory?) or raise max_retries."
        )

    async def _send(
        self, rep: _Replica, idxs, prompts, params, per_prompt, timeout, prefix, adapter=None
    ):
        rep.inflight += len(idxs)
        rep.idle.clear()
        try:
            sp = [params[i] for i in idxs] if per_prompt else params[0]
            ids = [f"{prefix}-{i}" for i in idxs]
            # Lists, not arrays: Ray gives every array its own out-of-band buffer.
            return await rep.actor.generate.remote(
                [prompts[i].tolist() for i in idxs], sp, ids, timeout, adapter
            )
        finally:
            rep.inflight -= len(idxs)
            if rep.inflight == 0:
                rep.idle.set()

    async def _loads(self, live: list[_Replica], strategies) -> list[ReplicaLoad]:
        kv: dict[int, ReplicaStats] = {}
        if "kv_cache" in strategies:
            stats = await asyncio.gather(
                *(r.actor.stats.remote() for r in live), return_exceptions=True
            )
            for rep, st in zip(live, stats, strict=True):
                if isinstance(st, ReplicaStats):
                    kv[rep.replica_id] = st
                else:
                    # Unknown usage: the kv_cache strategy then defers to the next strategy.
                    logger.debug("no stats from replica %d: %s", rep.replica_id, st)
        return [
            ReplicaLoad(
                replica_id=r.replica_id,
                outstanding=r.inflight,
                kv_cache_usage=kv[r.replica_id].kv_cache_usage if r.replica_id in kv else None,
                kv_capacity_tokens=r.info.kv_capacity_tokens if r.info else None,
            )
            for r in live
        ]

    async def _wait_for_ready(self) -> list[_Replica]:
        """Ready replicas; waits for one being (re)started when none is ready."""
        deadline = asyncio.get_running_loop().time() + self.config.startup_timeout
        while True:
            live = [r for r in self._replicas.values() if r.state == "ready"]
            if live:
                return live
            starting = any(r.state == "starting" for r in self._replicas.values())
            if self._closed or not starting or asyncio.get_running_loop().time() > deadline:
                raise NoHealthyReplicaError(
                    f"service {self.name} has no ready replica "
                    f"(states: { {r.replica_id: r.state for r in self._replicas.values()} }); "
                    "add replicas with add_replicas() or check the replicas' logs."
                )
            await asyncio.sleep(self.config.ready_poll_interval)


__all__ = ["BatchGeneration"]
