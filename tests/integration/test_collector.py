"""LLMCollector + VLLMPolicy on a toy env, weights pushed by collector.update_policy_weights_.

Every round: collect, check the samples carry the version that generated them (TorchRL's
counter and the engine's), perturb the trainer, push through the collector. The last
batch feeds GRPOLoss with a TransformersWrapper actor holding the pushed weights.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoTokenizer

from torchrl_vllm_ext import TokenCopyEnv, VLLMPolicy, WeightSyncScheme, WeightSyncUpdater

from ..helpers import CPU_TRANSPORTS, grpo_backward

ROUNDS = 3
ENV_BATCH = 4


@pytest.fixture
def scheme(service, restore_checkpoint, request):
    # One scheme per test: both transports serve versions 1..ROUNDS, and a scheme left
    # open would bring a restarted replica to *its* version of those numbers.
    with WeightSyncScheme(service, transport=request.param) as s:
        yield s


def perturb(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def sample_versions(batch) -> tuple[set[int], set[str]]:
    """(TorchRL's version of the step that generated each sample, the engine's)."""
    torchrl = set(batch.get(("next", "policy_version")).flatten().tolist())
    engine = set(batch.get(("vllm", "weight_version")).flatten().tolist())
    return torchrl, engine


@pytest.mark.parametrize("scheme", CPU_TRANSPORTS, indirect=True)
def test_collect_update_rounds_then_grpo(service, tiny_model, trainer, scheme):
    from torchrl.collectors.llm import LLMCollector

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    policy = VLLMPolicy(
        service, input_mode="tokens", sampling_params={"max_tokens": 6, "temperature": 1.0}
    )
    updater = WeightSyncUpdater(scheme)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # legacy weight_updater path
        collector = LLMCollector(
            TokenCopyEnv(batch_size=(ENV_BATCH,), prompt_len=4, seed=0),
            policy=policy,
            dialog_turns_per_batch=ENV_BATCH,
            weight_updater=updater,
            track_policy_version=True,
        )
    start = service.weight_version
    batches = iter(collector)

    batch = next(batches)
    assert sample_versions(batch) == ({0}, {start})
    for version in range(1, ROUNDS + 1):
        perturb(trainer, seed=1000 * (scheme.transport == "broadcast") + version)
        collector.update_policy_weights_(trainer)
        # Exactly one increment per update, and the engine serves the same number.
        assert collector.policy_version == version
        assert scheme.version == service.weight_version == str(version)
        assert updater.last_report.version == str(version)
        assert set(service.weight_versions().values()) == {str(version)}
        batch = next(batches)
        assert batch.numel() == ENV_BATCH
        assert sample_versions(batch) == ({version}, {str(version)})
        rewards = batch.get(("next", "reward"))
        assert rewards.shape == (ENV_BATCH, 1, 1, 1)
        assert ((rewards >= 0) & (rewards <= 1)).all()

    # The last batch was generated with the trainer's current weights: GRPO on it.
    data = batch.reshape(-1)
    reward = data.get(("next", "reward")).reshape(-1)
    advantage = reward - reward.mean()
    if not advantage.any():  # an untrained model rarely copies: still exercise the gradient
        advantage = torch.tensor([1.0, -1.0] * (ENV_BATCH // 2))
    data.set("advantage", advantage.view(-1, 1, 1))
    grpo_backward(trainer, tokenizer, data, pad_output=False)  # the pushed weights: ESS 1
    collector.shutdown()


def test_update_without_weights_says_what_to_pass(service, restore_checkpoint):
    from torchrl.collectors.llm import LLMCollector

    from torchrl_vllm_ext import ConfigurationError

    with WeightSyncScheme(service, transport="storage") as s, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        before = service.weight_version
        collector = LLMCollector(
            TokenCopyEnv(batch_size=(2,)),
            policy=VLLMPolicy(service, input_mode="tokens", sampling_params={"max_tokens": 2}),
            dialog_turns_per_batch=2,
            weight_updater=WeightSyncUpdater(s),
            track_policy_version=True,
        )
        with pytest.raises(ConfigurationError, match="needs the trainer's weights"):
            collector.update_policy_weights_()
        # Nothing was pushed and the version did not move.
        assert collector.policy_version == 0 and service.weight_version == before
        collector.shutdown()
