"""Batch generation through the service: completeness, order, exact log-probs, tags, timeouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchrl_vllm_ext import GenerationTimeoutError, RequestData

from ..helpers import hf_token_logprobs


def random_prompts(n: int, seed: int = 0, vocab: int = 500) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(5, 21))).tolist() for _ in range(n)]


def test_batch_of_64_with_n4_matches_transformers_logprobs(service, hf_model):
    prompts = random_prompts(64)
    outs = service.generate(
        prompts, {"max_tokens": 16, "n": 4, "temperature": 1.0, "prompt_logprobs": 0}
    )
    assert len(outs) == 64
    assert [o.prompt_token_ids for o in outs] == prompts, "outputs come back in input order"
    samples = [c for o in outs for c in o.outputs]
    assert len(samples) == 256
    worst = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.outputs) == 4
        # Prompt log-probs: position 0 has none, the rest match transformers.
        assert out.prompt_logprobs[0] is None or len(out.prompt_logprobs[0]) == 0
        ref_prompt = hf_token_logprobs(hf_model, prompt)
        got_prompt = torch.tensor(
            [out.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i > 0]
        )
        worst = max(worst, (got_prompt - ref_prompt).abs().max().item())
        for c in out.outputs:
            assert c.finish_reason in ("length", "stop") and len(c.token_ids) >= 1
            got = torch.tensor([c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)])
            ref = hf_token_logprobs(hf_model, prompt + list(c.token_ids))[len(prompt) - 1 :]
            worst = max(worst, (got - ref).abs().max().item())
            assert c.cumulative_logprob == pytest.approx(got.sum().item(), abs=1e-3)
    assert worst < 1e-4, f"max |vLLM - transformers| log-prob = {worst:.2e}"


def test_generate_request_data_returns_plain_numpy_with_version_tags(service):
    service.set_weight_version(5)
    try:
        data = service.generate_request_data(
            random_prompts(8, seed=1), {"max_tokens": 4, "n": 2, "ignore_eos": True}
        )
    finally:
        service.set_weight_version(0)
    assert all(isinstance(d, RequestData) for d in data)
    for d in data:
        assert d.weight_version_start == d.weight_version_end == "5"
        assert d.replica_id in service.replica_ids
        assert len(d.samples) == 2
        for s in d.samples:
            assert s.token_ids.dtype == np.int64 and s.logprobs.dtype == np.float32
            assert s.token_ids.shape == s.logprobs.shape == (4,)
            assert np.all(s.logprobs <= 0)


def test_per_prompt_sampling_params_and_seeds(service):
    prompts = random_prompts(4, seed=2)
    params = [{"max_tokens": 3 + i, "seed": 7, "temperature": 1.0} for i in range(4)]
    first = service.generate_request_data(prompts, params)
    again = service.generate_request_data(prompts, params)
    assert [len(d.samples[0].token_ids) for d in first] == [3, 4, 5, 6]
    for a, b in zip(first, again, strict=True):
        assert a.samples[0].token_ids.tolist() == b.samples[0].token_ids.tolist(), (
            "seeded samples repeat"
        )


def test_timeout_aborts_requests_inside_vllm(service):
    long = {"max_tokens": 200, "ignore_eos": True}
    with pytest.raises(GenerationTimeoutError, match="aborted in vLLM"):
        service.generate_request_data(random_prompts(8, seed=3), long, timeout=0.3)
    # The aborted requests would keep vLLM busy for seconds; after one more engine
    # step the schedulers must hold nothing.
    service.generate_request_data(random_prompts(2, seed=4), {"max_tokens": 1})
    for st in service.stats():
        assert (st.running, st.waiting, st.outstanding) == (0, 0, 0), st


def test_stats_are_read_from_vllm_under_load(service):
    import concurrent.futures

    from ..helpers import wait_until

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(
            service.generate_request_data,
            random_prompts(32, seed=5),
            {"max_tokens": 120, "ignore_eos": True},
            routing="round_robin",
        )
        busy = wait_until(
            lambda: [s for s in service.stats() if s.running > 0 and s.kv_cache_usage > 0],
            timeout=60,
            what="a replica reporting running requests and KV usage",
        )
        assert busy[0].outstanding > 0
        assert len(fut.result(timeout=300)) == 32
