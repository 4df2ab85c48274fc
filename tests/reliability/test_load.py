"""Thousands of concurrent requests through the service and the policy, without deadlock.

Client coroutines keep about 1,300 requests in flight at once for ``duration`` seconds
(10 by default: every client through many calls; minutes with ``--runslow``, where the
memory bound means more), half through ``VLLMService.agenerate_request_data``
and half through ``VLLMPolicy.aforward``. Every call must return a full answer; the
resident memory of the driver and the replicas is measured before and after (its
growth is checked against a generous bound: a correctness check for leaks, not a timing).
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from tensordict import TensorDict

from torchrl_vllm_ext import VLLMPolicy

from ..helpers import prompts, service_rss, wait_ready

logger = logging.getLogger(__name__)

SERVICE_CLIENTS, SERVICE_BATCH = 32, 32
POLICY_CLIENTS, POLICY_BATCH = 16, 16
MAX_TOKENS = 4
PARAMS = {"max_tokens": MAX_TOKENS, "ignore_eos": True}
HANG_GUARD_S = 600  # a call that takes this long is a deadlock, not a slow machine


async def run_load(service, policy, duration: float) -> dict[str, int]:
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + duration
    counts = {"service": 0, "policy": 0}

    async def service_client(i: int) -> None:
        k = 0
        while loop.time() < stop_at:
            batch = prompts(SERVICE_BATCH, seed=i * 1000 + k)
            k += 1
            data = await asyncio.wait_for(
                service.agenerate_request_data(batch, PARAMS), HANG_GUARD_S
            )
            assert [d.prompt_token_ids.tolist() for d in data] == batch
            assert all(len(d.samples[0].token_ids) == MAX_TOKENS for d in data)
            counts["service"] += len(batch)

    async def policy_client(i: int) -> None:
        k = 0
        while loop.time() < stop_at:
            ids = torch.tensor(prompts(POLICY_BATCH, seed=i * 7 + k))
            k += 1
            td = TensorDict({("tokens", "prompt"): ids}, batch_size=[POLICY_BATCH])
            out = await asyncio.wait_for(policy.aforward(td), HANG_GUARD_S)
            response = out.get(("tokens", "response"), as_list=True)
            assert len(response) == POLICY_BATCH
            assert all(r.numel() == MAX_TOKENS for r in response)
            counts["policy"] += POLICY_BATCH

    await asyncio.gather(
        *(service_client(i) for i in range(SERVICE_CLIENTS)),
        *(policy_client(i) for i in range(POLICY_CLIENTS)),
    )
    return counts


@pytest.mark.parametrize(
    "duration", [10, pytest.param(180, marks=pytest.mark.slow)], ids=lambda d: f"{d}s"
)
def test_concurrent_load_without_deadlock_and_flat_memory(service, duration):
    wait_ready(service)
    policy = VLLMPolicy(service, input_mode="tokens", sampling_params=PARAMS)
    asyncio.run(run_load(service, policy, 2.0))  # warm-up: caches, pools, lazy imports
    rss_start = service_rss(service)
    counts = asyncio.run(run_load(service, policy, duration))
    rss_end = service_rss(service)
    total = sum(counts.values())
    logger.info(
        "load %ss: %s requests (%.0f/s), RSS %.0f -> %.0f MB",
        duration,
        counts,
        total / duration,
        rss_start / 1e6,
        rss_end / 1e6,
    )
    concurrent = SERVICE_CLIENTS * SERVICE_BATCH + POLICY_CLIENTS * POLICY_BATCH
    assert total >= concurrent, "every client finished at least one call"
    assert rss_end < rss_start * 1.5 + 200e6, (
        f"RSS grew {rss_start / 1e6:.0f} -> {rss_end / 1e6:.0f} MB"
    )
    data = service.generate_request_data([[1, 2, 3]], {"max_tokens": 2, "ignore_eos": True})
    assert len(data[0].samples[0].token_ids) == 2
