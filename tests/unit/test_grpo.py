"""GRPO building blocks without vLLM: advantages, vocabulary mask, rollouts memmap, report."""

from __future__ import annotations

import json

import pytest
import torch
from tensordict import TensorDict, lazy_stack
from transformers import AutoModelForCausalLM

from torchrl_vllm_ext import ConfigurationError, TokenCountEnv
from torchrl_vllm_ext.envs import count_reward
from torchrl_vllm_ext.grpo import GRPOConfig, group_advantage, restrict_vocabulary
from torchrl_vllm_ext.grpo.report import breakdown_table, plot_run, summarize
from torchrl_vllm_ext.grpo.rollouts import RolloutRecorder
from torchrl_vllm_ext.testing import make_tiny_model


def test_group_advantage_standardises_within_groups():
    reward = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    adv = group_advantage(reward, group_size=4)
    groups = adv.view(2, 4)
    torch.testing.assert_close(groups.mean(-1), torch.zeros(2))
    assert groups[0].argmax() == 0 and groups[0, 0] > 0 > groups[0, 1]
    assert not groups[1].any()  # no signal in a group that all scored the same


def test_restricted_model_scores_like_a_masked_softmax():
    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(), dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        raw = model(ids).logits[0]
        handle = restrict_vocabulary(model, range(5, 15))
        masked = model(ids).logits[0].log_softmax(-1)
        handle.remove()
    # What vLLM reports with allowed_token_ids + processed log-probs: log-softmax over the
    # allowed ids only.
    expected = raw[:, 5:15].log_softmax(-1)
    torch.testing.assert_close(masked[:, 5:15], expected, atol=1e-6, rtol=0)
    assert (masked[:, :5].exp() == 0).all() and (masked[:, 15:].exp() == 0).all()


@pytest.mark.parametrize(
    ("last", "response", "expected"),
    [(8, [9, 5, 6], 1.0), (8, [9, 9, 5], 2 / 3), (14, [5], 1.0), (8, [], 0.0), (5, [5, 6], 0.5)],
)
def test_count_reward_counts_successor_steps(last, response, expected):
    got = count_reward(last, torch.tensor(response, dtype=torch.long), low=5, high=10)
    assert got == pytest.approx(expected)


def test_count_env_groups_share_prompts_and_score_full_answers():
    env = TokenCountEnv((8,), prompt_len=3, answer_len=4, group_size=4, seed=1)
    td = env.reset()
    prompt, answer = td["tokens", "prompt"], td["answer"]
    assert (prompt[:4] == prompt[0]).all() and (prompt[4:] == prompt[4]).all()
    assert not torch.equal(prompt[0], prompt[4]) or not torch.equal(answer[0], answer[4])
    rows = td.to_lazystack(0)
    for i, row in enumerate(rows.tensordicts):
        # Row i answers its first i//2 steps right, then stops: a short answer scores over 4.
        row.set(("tokens", "full"), torch.cat([prompt[i], answer[i][: i // 2]]))
    reward = env.step(rows)["next", "reward"].flatten()
    torch.testing.assert_close(reward, torch.tensor([i // 2 / 4 for i in range(8)]))


def test_count_env_rejects_groups_that_do_not_divide_the_batch():
    with pytest.raises(ConfigurationError, match="group_size=3"):
        TokenCountEnv((8,), group_size=3)


def _collector_like_batch(rows: int, prompt_len: int, answer_len: int, version: int):
    prompt = torch.arange(rows * prompt_len).view(rows, prompt_len)
    out = []
    for i in range(rows):
        n = answer_len if i % 2 == 0 else answer_len - 1  # ragged responses
        out.append(
            TensorDict(
                {
                    ("tokens", "prompt"): prompt[i],
                    ("tokens", "response"): torch.arange(n) + 100 * i,
                    ("log_probs", "response"): -torch.rand(n),
                    ("next", "reward"): torch.full((1, 1), i / rows),
                    ("vllm", "weight_version"): str(version),
                    "advantage": torch.full((1, 1), float(i)),
                }
            )
        )
    return lazy_stack(out)


def test_rollout_recorder_writes_steps_in_place(tmp_path):
    rec = RolloutRecorder(tmp_path / "r", steps=3, rows=4, prompt_len=2, response_len=3)
    rec.record(0, _collector_like_batch(4, 2, 3, version=0))
    rec.record(1, _collector_like_batch(4, 2, 3, version=1))
    loaded = TensorDict.load_memmap(tmp_path / "r")
    assert loaded.batch_size == (3, 4) and rec.recorded == 2
    assert loaded["step"][:2].tolist() == [[0] * 4, [1] * 4] and (loaded["step"][2] == -1).all()
    assert loaded["weight_version"][1].tolist() == [1, 1, 1, 1]
    assert loaded["response"][0, 1].tolist() == [100, 101, -1]  # ragged row padded with -1
    torch.testing.assert_close(loaded["advantage"][0], torch.arange(4.0))


def _fake_steps(n: int) -> list[dict]:
    return [
        {
            "step": i,
            "reward": min(1.0, 0.1 + i / n),
            "elapsed_s": float(i),
            "tokens_per_s": 100.0,
            "kl_to_engine": 1e-8,
            **{
                f"{p}_s": 0.1 * (k + 1)
                for k, p in enumerate(("generate", "score", "train", "sync"))
            },
        }
        for i in range(n)
    ]


def test_summary_finds_the_target_and_the_breakdown(tmp_path):
    steps = _fake_steps(40)
    s = summarize(steps, target=0.8, random_reward=0.1)
    assert s["reward_start"] == pytest.approx(0.1)
    assert s["reward_end"] > 0.8
    # The 10-step trailing mean crosses 0.8 where it should.
    assert 28 <= s["target_reached_step"] <= 35
    assert s["median_breakdown_s"] == pytest.approx(
        {"generate": 0.1, "score": 0.2, "train": 0.3, "sync": 0.4}
    )
    table = breakdown_table(s)
    assert "generate" in table and "40%" in table  # sync: 0.4 of a 1.0 s step
    png = plot_run(steps, s, tmp_path / "curve.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    json.dumps(s)  # JSON-ready


def test_summary_says_what_share_of_the_pushed_bytes_moved():
    steps = _fake_steps(4)
    for step, (share, delta) in zip(
        steps, [(0.5, False), (0.02, True), (0.03, True), (0.01, True)], strict=True
    ):
        step.update(sync_sent_share=share, sync_delta=delta)
    s = summarize(steps, target=0.8, random_reward=0.1)
    assert s["sync_delta_pushes"] == 3
    assert s["sync_sent_share_total"] == pytest.approx(0.14)
    assert s["sync_sent_share_median"] == pytest.approx(0.025)
    assert "sync_sent_share_total" not in summarize(_fake_steps(4), target=0.8, random_reward=0.1)


def test_config_rows_and_json():
    cfg = GRPOConfig(prompts_per_step=3, group_size=5)
    assert cfg.rows_per_step == 15
    assert json.loads(json.dumps(cfg.to_json()))["output"] == "grpo_demo"


def test_sample_seeds_are_per_row_and_reproducible():
    a = TokenCountEnv((4,), group_size=2, seed=3, sample_seeds=True)
    b = TokenCountEnv((4,), group_size=2, seed=3, sample_seeds=True)
    sa, sb = a.reset()["seed"], b.reset()["seed"]
    assert sa.dtype == torch.int64 and sa.shape == (4,) and torch.equal(sa, sb)
    assert len(set(sa.tolist())) == 4  # rows of a group sample differently
    assert "seed" not in TokenCountEnv((4,)).reset().keys()
