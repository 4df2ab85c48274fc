"""TokenCopyEnv without vLLM: reward, seeding, specs, and a TorchRL LLMCollector round.

NOTE: torchrl's check_env_specs does not apply: it draws a random ragged ``tokens.full``
(shape ``(*batch, -1)``), which no LLM env (ChatEnv included) can sample.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import lazy_stack

from torchrl_vllm_ext import ConfigurationError, TokenCopyEnv
from torchrl_vllm_ext.envs import copy_reward


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ([5, 6, 7, 8], 1.0),
        ([5, 6, 7, 8, 2, 2], 1.0),
        ([5, 9, 7], 0.5),
        ([], 0.0),
        ([8, 7, 6, 5], 0.0),
    ],
)
def test_copy_reward(response, expected):
    assert copy_reward(torch.tensor([5, 6, 7, 8]), torch.tensor(response, dtype=torch.long)) == (
        expected
    )


def test_same_seed_same_prompts_and_ids_in_range():
    a, b = TokenCopyEnv((3,), seed=7), TokenCopyEnv((3,), seed=7)
    for _ in range(3):
        pa, pb = a.reset()["tokens", "prompt"], b.reset()["tokens", "prompt"]
        assert torch.equal(pa, pb) and pa.dtype == torch.int64 and pa.shape == (3, 4)
        assert ((pa >= 5) & (pa < 15)).all()
    assert not torch.equal(TokenCopyEnv((3,), seed=8).reset()["tokens", "prompt"], pa)


def test_reset_matches_observation_spec():
    env = TokenCopyEnv((2,), prompt_len=3)
    td = env.reset()
    assert env.full_observation_spec["tokens", "prompt"].is_in(td["tokens", "prompt"])
    assert env.full_state_spec["answer"].is_in(td["answer"])


def test_step_scores_ragged_rows():
    env = TokenCopyEnv((2,), prompt_len=3, seed=0)
    td = env.reset()
    prompt = td["tokens", "prompt"]
    rows = td.to_lazystack(0)
    # Row 0 copies perfectly and keeps going; row 1 answers one wrong token and stops.
    rows.tensordicts[0].set(("tokens", "full"), torch.cat([prompt[0], prompt[0], prompt[0]]))
    rows.tensordicts[1].set(("tokens", "full"), torch.cat([prompt[1], prompt[1][:1] + 100]))
    out = env.step(rows)
    assert out["next", "reward"].shape == (2, 1, 1)
    assert out["next", "reward"].flatten().tolist() == [1.0, 0.0]
    assert out["next", "done"].all() and out["next", "terminated"].all()


def test_bad_arguments_say_what_to_change():
    with pytest.raises(ConfigurationError, match="prompt_len=0"):
        TokenCopyEnv((1,), prompt_len=0)
    with pytest.raises(ConfigurationError, match="low=9, high=3"):
        TokenCopyEnv((1,), low=9, high=3)


def test_llm_collector_collects_rewards():
    """A rule-based policy that copies all but the last token: reward (n-1)/n everywhere."""
    from torchrl.collectors.llm import LLMCollector

    def half_copier(td):
        rows = lazy_stack(list(td.unbind(0)))
        for row in rows.tensordicts:
            p = row["tokens", "prompt"]
            row.set(("tokens", "full"), torch.cat([p, p[:-1]]))
        return rows

    collector = LLMCollector(
        TokenCopyEnv((2,), prompt_len=4, seed=0),
        policy=half_copier,
        dialog_turns_per_batch=2,
        track_policy_version=True,
    )
    prompts = []
    for i, batch in enumerate(collector):
        assert batch["next", "reward"].flatten().tolist() == [0.75, 0.75]
        prompts.append(batch["tokens", "prompt"].clone())
        if i == 1:
            break
    collector.shutdown()
    assert not torch.equal(prompts[0], prompts[1])  # each reset poses new prompts
