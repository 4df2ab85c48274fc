"""ReferenceKL on real replicas: a TorchRL env transform whose reference log-probs equal
transformers', which TorchRL's LLMCollector and GRPOLoss take unchanged."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from torchrl_vllm_ext import ReferenceKL, TokenCountEnv, VLLMPolicy

from ..helpers import hf_token_logprobs


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def reference(service, tokenizer, pad_output: bool) -> ReferenceKL:
    ref = VLLMPolicy(
        service,
        input_mode="tokens",
        generate=False,
        log_probs_key="ref_log_probs",
        pad_output=pad_output,
        tokenizer=tokenizer,
    )
    return ReferenceKL(ref)


def per_sample(td, key) -> list[torch.Tensor]:
    value = td.get(key, as_list=True)
    if isinstance(value, torch.Tensor):
        return list(value.reshape(-1, value.shape[-1]).unbind(0))
    out = []
    for v in value:
        out.extend(v if isinstance(v, list) else [v])
    return out


def check_against_transformers(model, full, attn, ref_lp) -> None:
    """The reference's log-prob of each real token of ``full`` is transformers' (1e-4)."""
    for ids, mask, lp in zip(full, attn, ref_lp, strict=True):
        real = ids[mask.bool()].tolist()
        expected = hf_token_logprobs(model, real)
        torch.testing.assert_close(lp[mask.bool()][1:], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("pad_output", [False, True])
def test_collector_rollout_carries_reference_log_probs_and_kl(
    service, hf_model, tokenizer, pad_output
):
    from torchrl.collectors.llm import LLMCollector
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.objectives.llm import GRPOLoss

    # GRPO groups: 2 prompts x 3 samples; the env scores, the transform adds the reference.
    env = TokenCountEnv(batch_size=(6,), group_size=3, seed=0, sample_seeds=True)
    env = env.append_transform(reference(service, tokenizer, pad_output))
    policy = VLLMPolicy(
        service,
        input_mode="tokens",
        pad_output=pad_output,
        tokenizer=tokenizer,
        sampling_params={"max_tokens": 4, "allowed_token_ids": env.task_token_ids},
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The env passed to LLMCollector is missing")
        collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=6)
    batch = next(iter(collector)).reshape(-1)
    collector.shutdown()

    full = per_sample(batch, ("tokens", "full"))
    attn = per_sample(batch, ("masks", "all_attention_mask"))
    ref_lp = per_sample(batch, ("next", "ref_log_probs", "full"))
    assert [r.shape for r in ref_lp] == [f.shape for f in full]
    check_against_transformers(hf_model, full, attn, ref_lp)
    # Policy and reference hold the same weights: the KL to the reference is 0.
    kl = batch.get(("next", "kl_penalty"))
    assert kl.shape == (6, 1) and kl.abs().max() < 1e-3

    # TorchRL's GRPOLoss reads the reference from the batch: no trainer-side reference.
    actor = TransformersWrapper(
        hf_model, tokenizer=tokenizer, input_mode="tokens", generate=False, pad_output=pad_output
    )
    loss = GRPOLoss(actor, masking_strategy="sft", entropy_bonus=False, kl_to_ref_coeff=0.1)
    batch.set("advantage", torch.randn(6, 1, 1))
    out = loss(batch)
    assert torch.isfinite(out.loss_kl_to_ref) and abs(float(out.kl_to_ref)) < 1e-4


@pytest.mark.parametrize("pad_output", [False, True])
def test_reference_of_grouped_samples(service, hf_model, tokenizer, pad_output):
    # num_samples=G gives a (B, G) output; the transform scores every sample.
    policy = VLLMPolicy(
        service,
        input_mode="tokens",
        pad_output=pad_output,
        tokenizer=tokenizer,
        num_samples=2,
        sampling_params={"max_tokens": 5, "temperature": 1.0},
    )
    prompts = [[5, 6, 7, 8], [40, 41]]
    td = lazy_stack([TensorDict({("tokens", "prompt"): torch.tensor(p)}) for p in prompts])
    out = reference(service, tokenizer, pad_output)(policy(td))
    assert out.batch_size == (2, 2)
    check_against_transformers(
        hf_model,
        per_sample(out, ("tokens", "full")),
        per_sample(out, ("masks", "all_attention_mask")),
        per_sample(out, ("ref_log_probs", "full")),
    )
    assert out.get("kl_penalty").shape == (2, 2, 1)
    assert out.get("kl_penalty").abs().max() < 1e-3


def test_coeff_subtracts_the_kl_from_the_reward(service, tokenizer):
    ref = VLLMPolicy(
        service, input_mode="tokens", generate=False, log_probs_key="ref_log_probs", pad_output=True,
        tokenizer=tokenizer,
    )  # fmt: skip
    env = TokenCountEnv(batch_size=(4,), seed=1).append_transform(ReferenceKL(ref, coeff=2.0))
    policy = VLLMPolicy(service, input_mode="tokens", pad_output=True, tokenizer=tokenizer,
                        sampling_params={"max_tokens": 4, "ignore_eos": True})  # fmt: skip
    td = policy(env.reset())
    # A policy 0.5 nats less likely than the reference on each of its 4 response tokens.
    td.set(("log_probs", "full"), td.get(("log_probs", "full")) - 0.5)
    plain = TokenCountEnv(batch_size=(4,), seed=1)
    plain.reset()
    expected = plain.step(td.clone())["next", "reward"]
    got = env.step(td)["next"]
    torch.testing.assert_close(got["kl_penalty"], torch.full((4, 1), -2.0), atol=1e-3, rtol=0)
    torch.testing.assert_close(got["reward"], expected - 2.0 * got["kl_penalty"].reshape(4, 1, 1))


def test_a_generating_reference_is_refused(service):
    with pytest.raises(ValueError, match="generate=False"):
        ReferenceKL(VLLMPolicy(service, input_mode="tokens"))
