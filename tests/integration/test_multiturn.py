"""A multi-turn chat on TorchRL's ChatEnv, collected by LLMCollector with VLLMPolicy in
history mode: token-in / token-out turns, the engine's own log-probs at every turn."""

from __future__ import annotations

import warnings

import pytest
import torch

from torchrl_vllm_ext import VLLMPolicy
from torchrl_vllm_ext.envs import ScriptedChat

from ..helpers import hf_token_logprobs

QUERIES = ["hello there", "count to four", "red green blue"]
FOLLOW_UPS = ["go on", "and then?"]
TURNS = 3


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def dialogs(service, tokenizer):
    """One LLMCollector batch: 3 dialogs x 3 turns, shape (envs, turns)."""
    from torchrl.collectors.llm import LLMCollector
    from torchrl.envs.llm import ChatEnv

    env = ChatEnv(batch_size=(3,), tokenizer=tokenizer, input_mode="history")
    env = env.append_transform(ScriptedChat(tokenizer, QUERIES, FOLLOW_UPS, turns=TURNS))
    policy = VLLMPolicy(
        service,
        input_mode="history",
        tokenizer=tokenizer,
        prefer_tokens=True,
        sampling_params={"max_tokens": 6, "temperature": 1.0},
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The env passed to LLMCollector is missing")
        collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=3 * TURNS)
    batch = next(iter(collector))
    collector.shutdown()
    return batch


def per_turn(batch, key):
    """``[turn][env]`` 1-D tensors (the collector stacks turns on the last dim)."""
    return batch.get(key, as_list=True)


def test_dialogs_take_scripted_turns_and_end(dialogs):
    assert dialogs.batch_size == (3, TURNS)
    done = dialogs.get(("next", "done")).reshape(3, TURNS)
    assert done[:, -1].all() and not done[:, :-1].any()
    for env in range(3):
        history = dialogs[env, TURNS - 1]["history"].full
        assert list(history.role)[-2 * TURNS :] == ["user", "assistant"] * TURNS
        users = [c for r, c in zip(history.role, history.content, strict=True) if r == "user"]
        assert users == [QUERIES[env], *FOLLOW_UPS]


def test_each_turn_continues_the_exact_tokens_of_the_last(dialogs):
    prompts, fulls = per_turn(dialogs, ("tokens", "prompt")), per_turn(dialogs, ("tokens", "full"))
    for t in range(TURNS - 1):
        for env in range(3):
            previous = fulls[t][env]
            assert torch.equal(prompts[t + 1][env][: len(previous)], previous), (t, env)


def test_log_probs_are_the_engines_at_every_turn(dialogs, hf_model):
    fulls = per_turn(dialogs, ("tokens", "full"))
    responses = per_turn(dialogs, ("tokens", "response"))
    log_probs = per_turn(dialogs, ("log_probs", "response"))
    masks = per_turn(dialogs, ("masks", "all_assistant_mask"))
    for t in range(TURNS):
        for env in range(3):
            full, resp = fulls[t][env], responses[t][env]
            assert torch.equal(full[-len(resp) :], resp)
            assert int(masks[t][env].sum()) == len(resp)  # the loss sees this turn's reply
            expected = hf_token_logprobs(hf_model, full.tolist())[-len(resp) :]
            torch.testing.assert_close(log_probs[t][env], expected, atol=1e-4, rtol=0)
